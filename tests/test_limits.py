"""Size limits: one module, every door refuses what is over them with a typed error
naming the limit, and an oversized record costs its producer an immediate error,
never a stuck stream (nor a stuck producer, nor other streams)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import trio
import xxhash
from kera_client import open_admin, open_producer

from kera import chunk, frame, limits
from kera.broker.streamlet import Streamlet
from kera.errors import FrameTooLarge, InvalidArgument, LimitExceeded, RecordTooLarge
from kera.rpc import open_pool

from .conftest import stream_meta
from .workload import producer_id, stream_values

# -- one module --------------------------------------------------------------------------


def test_every_user_takes_its_limits_from_the_one_module():
    """No module of kera names a limit again: neither ``X = limits.Y`` nor ``from ..limits
    import Y as X``; a limit is read as ``limits.Y`` or imported under its own name."""
    import ast
    import pathlib

    root = pathlib.Path(limits.__file__).parent
    again = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) \
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "limits":
                again.append(f"{path.relative_to(root)}: {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("limits"):
                again += [f"{path.relative_to(root)}: {a.name} as {a.asname}" for a in node.names
                          if a.asname not in (None, a.name)]
    assert not again, again
    assert frame.MAX_META == limits.MAX_META and frame.PREFIX_SIZE == limits.FRAME_PREFIX
    assert frame.FrameDecoder().max_frame == limits.MAX_FRAME
    assert not hasattr(frame, "DEFAULT_MAX_FRAME")


def test_errors_name_their_limit_across_the_wire():
    from kera.errors import from_wire

    e = from_wire(RecordTooLarge("too big", limit="MAX_CHUNK", bound=5, size=7).to_wire())
    assert type(e) is RecordTooLarge and (e.limit, e.bound, e.size) == ("MAX_CHUNK", 5, 7)
    assert isinstance(e, LimitExceeded) and isinstance(e, InvalidArgument)


# -- frames ---------------------------------------------------------------------------------


def test_frames_over_the_limits_are_not_built():
    with pytest.raises(FrameTooLarge, match="MAX_META"):
        frame.encode(frame.REQUEST, 1, {"s": "x" * limits.MAX_META})
    mib = memoryview(bytes(1 << 20))
    parts = [mib] * (limits.MAX_FRAME >> 20)  # 64 MiB of payload, no copy: over with the prefix
    with pytest.raises(FrameTooLarge, match="MAX_FRAME"):
        frame.encode_parts(frame.REQUEST, 1, {}, parts)
    with pytest.raises(FrameTooLarge, match="MAX_FRAME"):
        frame.encode(frame.REQUEST, 1, {}, np.zeros(limits.MAX_FRAME, np.uint8))
    # the largest payload the limits promise fits, whatever the meta
    meta = {"s": "x" * (limits.MAX_META - 16)}
    tail = memoryview(bytes(limits.MAX_PAYLOAD % (1 << 20)))
    f = frame.encode_parts(frame.REQUEST, 1, meta, [mib] * (limits.MAX_PAYLOAD >> 20) + [tail])
    dec = frame.FrameDecoder()
    dec.feed(f)
    assert dec.next().payload.nbytes == limits.MAX_PAYLOAD


# -- chunks ---------------------------------------------------------------------------------


def test_chunks_over_max_chunk_are_refused_and_at_it_accepted():
    room = chunk.record_room(limits.MAX_CHUNK)   # 16 + key + value bytes of one record
    exact = chunk.build(1, 0, 1, 0, [b"v" * (room - 16)])
    assert len(exact) == limits.MAX_CHUNK == chunk.chunk_size(1, room - 16)
    chunk.verify(exact)
    with pytest.raises(RecordTooLarge) as e:
        chunk.build(1, 0, 1, 0, [b"v" * (room - 15)])
    assert e.value.limit == "MAX_CHUNK" and e.value.bound == limits.MAX_CHUNK
    with pytest.raises(RecordTooLarge):
        chunk.build(1, 0, 1, 0, [b"v" * (room - 20)], keys=[b"kkkkk"])
    n = 2
    ts = np.zeros(n, np.int64)
    koff = np.zeros(n + 1, np.uint32)
    voff = np.array([0, room // 2, room], np.uint32)
    with pytest.raises(RecordTooLarge):
        chunk.build_arrays(1, 0, 1, 0, ts, koff, b"", voff, b"v" * room)


def test_chunks_over_max_records_are_refused():
    n = limits.MAX_RECORDS + 1  # zero-copy columns: the count alone is refused
    ts = np.broadcast_to(np.int64(0), (n,))
    off = np.broadcast_to(np.uint32(0), (n + 1,))
    with pytest.raises(LimitExceeded) as e:
        chunk.build_arrays(1, 0, 1, 0, ts, off, b"", off, b"")
    assert e.value.limit == "MAX_RECORDS"


def test_streamlet_refuses_chunks_over_its_segment_or_max_chunk():
    small = Streamlet(stream_meta(segment_size=8192, group_segments=2), 0)
    ok = chunk.build(1, 0, 1, 0, [b"v" * (chunk.record_room(8192) - 16)])
    assert len(ok) == 8192
    small.append(ok, 1)
    with pytest.raises(RecordTooLarge) as e:
        small.append(chunk.build(1, 0, 1, 1, [b"v" * 8192]), 1)
    assert e.value.limit == "segment_size" and e.value.bound == 8192
    big = Streamlet(stream_meta(id=2, segment_size=64 << 20, group_segments=2), 0)
    with pytest.raises(RecordTooLarge) as e:
        big.append(bytes(limits.MAX_CHUNK + 8), 1)
    assert e.value.limit == "MAX_CHUNK" and e.value.bound == limits.MAX_CHUNK
    assert small.appended_chunks == 1 and big.appended_chunks == 0


def test_broker_vseg_size_is_bounded():
    from kera.broker.main import main

    for bad in ("0", str(limits.MAX_VSEG_SIZE + 1)):
        with pytest.raises(SystemExit) as e:
            main(["--vseg-size", bad, "--port", "0"])
        assert e.value.code == 2


def test_coordinator_chunk_rows_newest_is_bytes_and_checked_before_anything_is_made(tmp_path, capsys):
    from kera.coordinator.main import main

    data = tmp_path / "coordinator"
    with pytest.raises(SystemExit) as e:
        main(["--chunk-rows-newest", "-1", "--data", str(data), "--port", "0"], open_log=None)
    assert e.value.code == 2 and "--chunk-rows-newest is a number of bytes" in capsys.readouterr().err
    assert not data.exists()


# -- real processes -----------------------------------------------------------------------


def oversized_chunk(stream_id: int, streamlet: int, producer: int, seq: int, nbytes: int) -> bytes:
    """A well-formed chunk larger than MAX_CHUNK (the builders refuse to make one)."""
    body_len = nbytes - chunk.HEADER_SIZE
    data = body_len - 24
    body = b"".join((bytes(8), bytes(4 * 2), np.array([0, data], "<u4").tobytes(), b"z" * data))
    head = bytearray(chunk.HEADER.pack(chunk.MAGIC, chunk.VERSION, 0, stream_id, streamlet, 1, producer,
                                       seq, 0, 0, chunk.NO_PLACEMENT, chunk.NO_PLACEMENT,
                                       chunk.NO_PLACEMENT, body_len, xxhash.xxh3_64_intdigest(body), 0, 0))
    chunk.place(head, 0, chunk.NO_PLACEMENT, chunk.NO_PLACEMENT, chunk.NO_PLACEMENT)  # seals the header
    out = bytes(head) + body
    chunk.verify(out)
    return out


async def test_oversized_record_refused_at_once_other_streams_go_on(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        # allowed (<= MAX_SEGMENT_SIZE), but chunks still stop at MAX_CHUNK: the backups' limit
        big = await a.create_stream("big", segment_size=64 << 20)
        small = await a.create_stream("small", segment_size=64 << 10)
        await a.create_stream("other")
        for bad, limit in (({"streamlets": limits.MAX_STREAMLETS + 1}, "MAX_STREAMLETS"),
                           ({"groups": limits.MAX_GROUPS + 1}, "MAX_GROUPS"),
                           ({"segment_size": limits.MAX_SEGMENT_SIZE + 1}, "MAX_SEGMENT_SIZE"),
                           ({"segment_size": limits.MIN_SEGMENT_SIZE - 1}, "MIN_SEGMENT_SIZE")):
            with pytest.raises(LimitExceeded) as e:
                await a.create_stream("refused", **bad)
            assert e.value.limit == limit and limit in str(e.value)
        assert sorted(s.name for s in await a.list_streams()) == ["big", "other", "small"]
    record = b"x" * 40_000_000
    with trio.fail_after(60):
        async with open_producer(coord, **{"request.size": 1 << 40, "chunk.size": 1 << 40}) as p:
            assert p.request_size == limits.MAX_REQUEST and p.chunk_size == limits.MAX_CHUNK
            # known streams (one not known yet refuses what no chunk holds at once, and what
            # its segments cannot hold once its lookup answers: test_delivery)
            await p.load_metadata(["big", "small", "other"])
            await p.send("big", b"before")
            with trio.fail_after(5):  # at once: no waiting for an answer that never comes
                with pytest.raises(RecordTooLarge) as e:
                    await p.send("big", record)
            assert e.value.limit == "MAX_CHUNK" and e.value.bound == limits.MAX_CHUNK
            assert "MAX_CHUNK" in str(e.value) and "'big'" in str(e.value)
            room = chunk.record_room(64 << 10)
            with pytest.raises(RecordTooLarge) as e:
                await p.send("small", b"y" * room)
            assert e.value.limit == "segment_size" and e.value.bound == 64 << 10
            with pytest.raises(RecordTooLarge):  # the batch path: none of the batch is sent
                await p.send_many("other", [b"a", record, b"b"])
            await p.send("small", b"y" * (room - 16))   # exactly one segment: fine
            for i in range(3):
                await p.send("small", b"s%d" % i)        # each seals the one before: never too large
                await p.send("other", b"o%d" % i)
            await p.send("big", b"after")
            await p.flush()
            assert p.acked == 9 and p.failed == 0
        assert await stream_values(coord, "big", 2) == [b"before", b"after"]
        assert await stream_values(coord, "other", 3) == [b"o0", b"o1", b"o2"]
        assert await stream_values(coord, "small", 4) == [b"y" * (room - 16), b"s0", b"s1", b"s2"]

        # a producer that does not check: the broker refuses those chunks only, typed
        mine = await producer_id(coord)
        pid = mine["producer"]
        async with open_pool() as pool:
            parts = [chunk.build(small.id, 0, pid, 0, [b"z" * (70 << 10)]),
                     chunk.build(small.id, 0, pid, 0, [b"fits"]),
                     oversized_chunk(big.id, 0, pid, 0, limits.MAX_CHUNK + 4096)]
            r, _ = await pool.call(big.addrs[0], "produce", mine, parts=parts, timeout=30)
            assert r["errors"] == [[0, "record_too_large"], [2, "record_too_large"]]
        assert await stream_values(coord, "small", 5) == [b"y" * (room - 16), b"s0", b"s1", b"s2", b"fits"]
        assert await stream_values(coord, "big", 2) == [b"before", b"after"]


def test_cli_produce_reports_an_oversized_line_and_sends_the_others(make_cluster):
    cluster = make_cluster(1)
    env = dict(os.environ, KERA_COORDINATOR=cluster.coordinator)
    kera = [sys.executable, "-m", "kera"]
    subprocess.run(kera + ["stream", "create", "big", "--segment-size", str(64 << 20)], env=env,
                   check=True, capture_output=True, timeout=60)
    lines = b"first\n" + b"x" * 40_000_000 + b"\nlast\n"
    r = subprocess.run(kera + ["produce", "big"], input=lines, env=env, capture_output=True, timeout=60)
    assert r.returncode == 1
    err = r.stderr.decode()
    assert "line 2: record_too_large" in err and "MAX_CHUNK" in err, err
    assert b"acknowledged: 2" in r.stdout
    r = subprocess.run(kera + ["consume", "big", "--max", "2", "--timeout", "5"], env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == b"first\nlast\n"
