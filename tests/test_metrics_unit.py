"""The metrics' parts in-process: records counted per chunk in a segment, the endpoint's
HTTP handling (bad requests answered, the endpoint keeps serving), RPC timing of plain,
``Later`` and coroutine answers."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import trio

from kera import chunk
from kera.broker.segment import Segment
from kera.metrics.endpoint import Metrics
from kera.rpc import Later


def test_a_segment_counts_records_between_chunk_boundaries():
    seg = Segment(0, 1 << 20)
    sizes = [3, 1, 7, 2]
    ends = []
    for i, n in enumerate(sizes):
        c = chunk.build(1, 0, 9, i, [b"v%d" % j for j in range(n)])
        seg.append(c)
        ends.append(seg.head)
    assert seg.records_in(0, seg.head) == 13
    assert seg.records_in(ends[0], seg.head) == 10
    assert seg.records_in(ends[0], ends[2]) == 8
    assert seg.records_in(ends[3], ends[3]) == 0
    seg.ends = seg.ends[:2]      # chunks known by their ends only (adopted): not counted
    assert seg.records_in(0, ends[1]) is None


class Handlers:
    def rpc_plain(self, meta, payload):
        return {"ok": 1}

    def rpc_later(self, meta, payload):
        self.pending = Later()
        return self.pending

    async def rpc_slow(self, meta, payload):
        await trio.sleep(0.01)
        return {"ok": 2}

    def rpc_bad(self, meta, payload):
        raise ValueError("no")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def test_endpoint_serves_text_and_answers_bad_requests():
    m = Metrics("broker")
    h = Handlers()
    m.time_rpcs(h)
    assert h.rpc_plain({}, b"") == {"ok": 1}
    answered = []
    later = h.rpc_later({}, b"")
    later._bind(answered.append)
    h.pending.done({"late": True})
    assert answered == [{"late": True}]
    assert await h.rpc_slow({}, b"") == {"ok": 2}
    with pytest.raises(ValueError):
        h.rpc_bad({}, b"")
    async with trio.open_nursery() as n:
        port = await n.start(m.serve, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        status, body = await trio.to_thread.run_sync(_get, base + "/metrics")
        assert status == 200
        for rpc in ("plain", "later", "slow", "bad"):
            assert f'kera_broker_request_latency_seconds_count{{rpc="{rpc}"}} 1.0' in body.decode()
        assert (await trio.to_thread.run_sync(_get, base + "/elsewhere"))[0] == 404
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"\x00\x01 not http\r\n\r\n")
        await s.aclose()
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"POST /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert b" 405 " in await s.receive_some(1000)
        await s.aclose()
        assert (await trio.to_thread.run_sync(_get, base + "/metrics"))[0] == 200
        n.cancel_scope.cancel()
