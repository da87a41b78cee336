"""Delivery reports: exactly one per record (or batch call), typed errors, served on the
caller's thread, in order per streamlet, and exact across a broker's SIGKILL."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest
import trio
from kera_client import (
    BatchReport,
    DeliveryReport,
    ProduceError,
    Producer,
    open_admin,
    open_consumer,
    open_producer,
)

from kera import position
from kera.errors import DeliveryTimeout, RecordTooLarge, UnknownStream

from .workload import create


class Reports:
    """Every (error, report) a callback got, and the threads it ran on."""

    def __init__(self):
        self.got: list = []
        self.threads: set = set()

    def __call__(self, error, report):
        self.got.append((error, report))
        self.threads.add(threading.get_ident())

    def ok(self) -> list:
        return [r for e, r in self.got if e is None]


async def chunks_of(coord, streams, want: int, timeout: float = 30.0) -> dict:
    """(stream, streamlet, group, segment, offset) -> values, until ``want`` records arrived."""
    out, n = {}, 0
    async with open_consumer(streams, coord, start="earliest") as c:
        with trio.move_on_after(timeout):
            while n < want:
                for ch in await c.poll_chunks(1.0):
                    seg, off = position.unpack(ch.position)
                    out[(ch.stream, ch.streamlet, ch.group, seg, off)] = ch.values()
                    n += len(ch)
    return out


def readable(chunks: dict, r: DeliveryReport) -> bool:
    vals = chunks.get((r.stream, r.streamlet, r.group, r.segment, r.offset))
    return vals is not None and vals[r.index] == r.value


async def test_one_report_per_record_served_on_the_callers_thread(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    await create(coord, ["d1", "d2"], streamlets=2, replication=1)
    default, own, n = Reports(), Reports(), 3000

    def produce():
        with Producer(coord, on_delivery=default, **{"chunk.size": 1024, "linger.ms": 2}) as p:
            for i in range(n):
                s, v = ("d1", "d2")[i % 2], b"%06d" % i
                if i % 3 == 0:
                    p.send(s, v, key=b"k%d" % (i % 5), on_delivery=own)
                else:
                    p.send(s, v, key=b"k%d" % (i % 5))
            p.portal.call(p._p.flush)  # all acknowledged on the network thread...
            assert p.acked == n
            idle = len(default.got) + len(own.got)
            served = p.poll()                   # ... but reported only now, here
            assert served == n - idle and p.poll() == 0
            return threading.get_ident()

    me = await trio.to_thread.run_sync(produce)
    assert len(own.got) == n // 3 and len(default.got) == n - n // 3
    assert default.threads == own.threads == {me}
    reports = own.ok() + default.ok()
    assert sorted(r.value for r in reports) == [b"%06d" % i for i in range(n)]  # once each
    assert all(0 <= r.latency < 30 for r in reports)
    chunks = await chunks_of(coord, ["d1", "d2"], n)
    assert all(readable(chunks, r) for r in reports)
    # one key: one streamlet, and reports in send order there are in position order
    for k in range(5):
        mine = sorted((r for r in reports if r.key == b"k%d" % k), key=lambda r: r.value)
        for s in ("d1", "d2"):
            at = [(r.group, r.segment, r.offset, r.index) for r in mine if r.stream == s]
            assert len({r.streamlet for r in mine if r.stream == s}) == 1 and at == sorted(at)


async def test_sampled_callbacks_over_many_streams_get_their_own_positions(make_cluster):
    """One record to each of many streams, a callback on every 7th only: a request carries
    many one-record chunks and the broker answers where it placed only those with reports
    (``positions_of``); each report still names its own record's place."""
    cluster = make_cluster(1)
    coord = cluster.coordinator
    names = [f"sp{i:03d}" for i in range(300)]
    await create(coord, names, replication=1)
    got = Reports()

    def produce():
        with Producer(coord, **{"linger.ms": 2}) as p:
            p.portal.call(p._p.load_metadata, names)
            for rnd in range(2):
                for i, s in enumerate(names):
                    v = b"%d-%s" % (rnd, s.encode())
                    if i % 7 == 3:
                        p.send(s, v, on_delivery=got)
                    else:
                        p.send(s, v)
            p.flush()

    await trio.to_thread.run_sync(produce)
    reports = got.ok()
    assert len(reports) == len(got.got) == 2 * len(range(3, 300, 7))
    chunks = await chunks_of(coord, names, 2 * len(names))
    assert all(readable(chunks, r) for r in reports)


async def test_failures_are_reported_with_typed_errors(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    await create(coord, ["small", "doomed"], segment_size=4096, replication=1)
    rep = Reports()

    def produce():
        with Producer(coord, on_delivery=rep, **{"delivery.timeout.ms": 1500, "linger.ms": 1}) as p:
            p.send("small", b"x" * 5000)               # no chunk of the stream holds it
            p.send("nowhere", b"y")                    # no such stream
            p.send("small", b"fits")
            p.flush(30)                                # all reported: flush does not raise
            assert p.poll() == 0
            trio.run(delete, "doomed")
            p.send("doomed", b"after delete")          # the producer still has its metadata
            p.flush(30)
            cluster.kill("node1-broker")               # nothing can take its streamlets
            p.send("small", b"lost")
            p.flush(30)
            before = len(rep.got)
            p.send("small", b"plain", on_delivery=None)  # the producer-wide callback still applies
            p.flush(30)
            assert len(rep.got) == before + 1

    async def delete(name):
        async with open_admin(coord) as a:
            await a.delete_stream(name)

    await trio.to_thread.run_sync(produce)
    errors = [(type(e), r.value) for e, r in rep.got]
    assert errors[:3] == [(RecordTooLarge, b"x" * 5000), (UnknownStream, b"y"), (type(None), b"fits")]
    assert errors[3:] == [(UnknownStream, b"after delete"), (DeliveryTimeout, b"lost"),
                          (DeliveryTimeout, b"plain")]
    assert all(r.group is None for e, r in rep.got if e is not None)


async def test_without_callbacks_flush_raises_for_the_failed(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    await create(coord, ["quiet"], segment_size=4096, replication=1)

    def produce():
        p = Producer(coord, **{"delivery.timeout.ms": 1000, "linger.ms": 1})
        try:
            p.send("quiet", b"x" * 5000)   # no callback, and the stream not known yet: flush says
            with pytest.raises(ProduceError, match="1 records failed: record_too_large"):
                p.flush(30)
            with pytest.raises(RecordTooLarge):        # a known stream's: refused at once
                p.send("quiet", b"x" * 5000)
            cluster.kill("node1-broker")
            p.send("quiet", b"lost")
            with pytest.raises(ProduceError, match="2 records failed: record_too_large; delivery timeout"):
                p.flush(30)
        finally:
            p.portal.close()

    await trio.to_thread.run_sync(produce)


async def test_async_producer_awaits_records_and_batches(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    await create(coord, ["a"], streamlets=2, replication=1)
    default = Reports()
    async with open_producer(coord, on_delivery=default, **{"chunk.size": 512, "linger.ms": 1}) as p:
        for i in range(50):
            await p.send("a", b"d%d" % i)                 # the producer-wide callback, on this loop
        handles = [await p.send("a", b"r%d" % i, key=b"k", report=True) for i in range(200)]
        batch = await p.send_many("a", np.full((1000, 20), ord("z"), dtype=np.uint8), report=True)
        with pytest.raises(UnknownStream):
            await (await p.send("missing", b"v", report=True))
        records = [await h for h in handles]
        b = await batch
    assert sorted(r.value for r in default.ok()) == sorted(b"d%d" % i for i in range(50))
    assert default.threads == {threading.get_ident()}
    assert [r.value for r in records] == [b"r%d" % i for i in range(200)]
    at = [(r.group, r.segment, r.offset, r.index) for r in records]
    assert at == sorted(at) and len({r.streamlet for r in records}) == 1
    assert isinstance(b, BatchReport) and (b.records, b.acked, b.failed) == (1000, 1000, 0)
    assert sum(c[4] for c in b.chunks) == 1000 and len(b.chunks) > 1


async def test_broker_killed_yields_one_report_per_record(make_cluster):
    """SIGKILL of a broker mid-run: every record is reported exactly once (acknowledged
    after its streamlets are recovered, or failed) and every acknowledged one is readable."""
    cluster = make_cluster(4)
    coord = cluster.coordinator
    streams = [f"k{i:02d}" for i in range(32)]
    await create(coord, streams, replication=3)
    rep, n = Reports(), 40_000

    def produce():
        with Producer(coord, on_delivery=rep, **{"linger.ms": 2, "chunk.size": 2048}) as p:
            for i in range(n):
                p.send(streams[i % len(streams)], b"%08d" % i)
                if i == n // 3:  # records in flight and buffered
                    cluster.kill("node2-broker")
            p.flush(180)

    with trio.fail_after(240):
        await trio.to_thread.run_sync(produce)
        values = sorted(r.value for e, r in rep.got)
        assert values == [b"%08d" % i for i in range(n)]    # each reported exactly once
        ok = rep.ok()
        print(f"broker killed: {len(ok)} of {n} records acknowledged, "
              f"{sum(r.group is None for r in ok)} of them as resends already held")
        assert len(ok) > n // 3
        chunks = await chunks_of(coord, streams, len(ok), timeout=60)
    assert all(readable(chunks, r) for r in ok if r.group is not None)
    stored = {v for vals in chunks.values() for v in vals}
    assert all(r.value in stored for r in ok)


def test_a_failing_callback_leaves_the_other_reports_queued():
    from kera_client.accumulator import Outgoing
    from kera_client.delivery import Deliveries
    from kera_client.lanes import Route

    d, got = Deliveries(queued=True), []

    def cb(error, report):
        got.append(report.value)
        if report.value == b"bad":
            raise ValueError("callback failed")

    entries = [(i, cb, 0.0, None, v) for i, v in enumerate([b"a", b"bad", b"c"])]
    lane = Route("s", 1, 1, 1 << 20, ("127.0.0.1:1",), ((1, 1),)).lane(0)
    d.settle(Outgoing.packed(lane, 0, b"", 3, 0.0, entries), "s", None, (0, 0, 64))
    with pytest.raises(ValueError):
        d.serve()
    assert d.serve() == 1 and got == [b"a", b"bad", b"c"] and d.serve() == 0


async def test_bad_records_are_refused_at_send_and_a_stopped_batch_still_reports(make_cluster):
    """A value that is not bytes is a TypeError at ``send``, and the producer goes on; a
    batch call cancelled while it waits for buffer space reports once, with what it queued
    acknowledged and the rest failed."""
    cluster = make_cluster(1)
    coord = cluster.coordinator
    await create(coord, ["b"], streamlets=1, replication=1)
    with trio.fail_after(60):
        async with open_producer(coord, **{"buffer.memory": 4096, "linger.ms": 1000}) as p:
            for bad in ({"value": "text"}, {"value": b"v", "key": 7}, {"value": b"v", "timestamp": "now"}):
                with pytest.raises(TypeError):
                    await p.send("b", **bad)
            h = await p.send("b", b"fine", report=True)
            assert (await h).group is not None
            broker = next(n for n in cluster.procs if n.endswith("broker"))
            values = [b"x" * 100] * 1000     # far past buffer.memory, with nothing acknowledged:
            cluster.kill(broker, signal.SIGSTOP)   # the call waits for space, and is cancelled
            got = []
            try:
                with trio.move_on_after(0.5) as scope:
                    await p.send_many("b", values, on_delivery=lambda e, r: got.append((e, r)))
                assert scope.cancelled_caught and got == []
            finally:
                cluster.kill(broker, signal.SIGCONT)
            await p.flush()
            assert len(got) == 1
            error, report = got[0]
            assert error is not None and report.records == 1000
            assert 0 < report.acked < 1000 and report.failed == 1000 - report.acked
