"""Bad input against a live broker and coordinator: a typed error (or the
connection closed for garbage), the server keeps serving, nothing stored changes."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import trio
from kera_client import ProduceError, open_admin, open_consumer, open_producer
from kera_client.stream_view import StreamView

from kera import chunk, frame
from kera.errors import (
    ChecksumError,
    FrameTooLarge,
    InvalidName,
    KeraError,
    ProtocolError,
    UnknownStream,
)
from kera.rpc import open_pool, parse_addr

from .members import open_members
from .workload import producer_id, read_values


def raw(addr: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes on a fresh connection, half-close, return all the server said."""
    with socket.create_connection(parse_addr(addr), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not b:
                break
            out += b
        return out


def error_codes(reply: bytes) -> list[str]:
    d = frame.FrameDecoder()
    d.feed(reply)
    codes = []
    while (f := d.next()) is not None:
        assert f.kind == frame.ERROR
        codes.append(f.meta["code"])
    return codes


@pytest.fixture
def cluster(make_cluster):
    return make_cluster(2)


GOOD = 100  # records in stream 'good'


async def stored(coord) -> tuple[int, int, int]:
    """(chunks, bytes) appended on all brokers, and records readable from stream 'good'
    (read until the GOOD that ``setup_good`` wrote, plus any surplus)."""
    async with open_admin(coord) as a:
        st = await a.broker_stats()
    chunks, nbytes = sum(r["chunks"] for r in st), sum(r["bytes"] for r in st)
    async with open_consumer(["good"], coord) as c:
        n = len(await read_values(c, GOOD))
    return chunks, nbytes, n


async def setup_good(coord) -> StreamView:
    async with open_admin(coord) as a:
        s = await a.create_stream("good", streamlets=2, replication=2)
    async with open_producer(coord) as p:
        for i in range(GOOD):
            await p.send("good", b"v%d" % i)
    return s


async def test_garbage_frames_are_refused_and_servers_keep_serving(cluster):
    coord = cluster.coordinator
    s = await setup_good(coord)
    broker = s.addrs[0]
    before = await stored(coord)
    assert before[2] == GOOD
    good = frame.encode(frame.REQUEST, 7, {"m": "list_streams"})
    for addr in (coord, broker):
        # truncated frame: the server waits for the rest, then sees the close; nothing answered
        assert raw(addr, good[: len(good) - 3]) == b""
        # random bytes: a protocol error, connection closed
        assert set(error_codes(raw(addr, os.urandom(4096)))) <= {ProtocolError.code}
        # a frame announcing 4 GiB: refused from its 16-byte prefix
        huge = frame.PREFIX.pack(frame.MAGIC, frame.VERSION, frame.REQUEST, 1, 10, 0xFFFFFFF0)
        assert error_codes(raw(addr, huge)) == [FrameTooLarge.code]
        # meta that is not msgpack
        bad_meta = frame.PREFIX.pack(frame.MAGIC, frame.VERSION, frame.REQUEST, 1, 4, 0) + b"\xc1\xc1\xc1\xc1"
        assert error_codes(raw(addr, bad_meta)) == [ProtocolError.code]
        # an unknown method is a typed error on a connection that stays usable
        async with open_pool() as pool:
            with pytest.raises(Exception) as e:
                await pool.call(addr, "no_such_method", {}, timeout=5)
            assert getattr(e.value, "code", "") == "unknown_method"
            await pool.call(addr, "stats" if addr == broker else "list_streams", {}, timeout=5)
    assert await stored(coord) == before


async def test_bad_chunks_unknown_streams_and_foreign_streamlets(cluster):
    coord = cluster.coordinator
    s = await setup_good(coord)
    before = await stored(coord)
    broker = s.addrs[0]
    mine = await producer_id(coord)
    pid = mine["producer"]
    async with open_pool() as pool:
        good = chunk.build(s.id, 0, pid, 0, [b"x" * 50] * 3)
        bad = bytearray(good)
        bad[-9] ^= 0x10  # a bit in the body: the body checksum no longer matches
        with pytest.raises(ChecksumError):
            await pool.call(broker, "produce", mine, good + bytes(bad), timeout=5)
        torn = bytearray(good)[:-5]
        with pytest.raises(ProtocolError):
            await pool.call(broker, "produce", mine, bytes(torn), timeout=5)
        # a chunk for a stream no broker has: refused for that chunk, typed
        r, _ = await pool.call(broker, "produce", mine, chunk.build(424242, 0, pid, 0, [b"x"]), timeout=5)
        assert r["errors"] == [[0, "not_owner"]]
        # positions asked for chunks by index: 4-byte indices of its chunks, else refused whole,
        # typed, before anything is stored (``stored`` below)
        for bad_of in (b"\x00\x00\x00", "0", (1).to_bytes(4, "little"), bytes(8)):
            with pytest.raises(Exception) as e:
                await pool.call(broker, "produce", {**mine, "positions_of": bad_of}, good, timeout=5)
            assert e.value.code == "invalid_argument"
        # a pull for a streamlet this broker does not own: a typed error for that streamlet
        other = 1 if s.addrs[1] != broker else None
        foreign = [[s.id, other, 0, {}]] if other is not None else [[s.id, 5, 0, {}]]
        r, _ = await pool.call(broker, "pull", {"streamlets": foreign + [[777, 0, 0, {}]]}, timeout=5)
        assert [e[2] for e in r["errors"]] == ["not_owner", "not_owner"] and r["entries"] == []
        # malformed pull requests
        with pytest.raises(Exception) as e:
            await pool.call(broker, "pull", {"streamlets": "nope"}, timeout=5)
        assert e.value.code == "invalid_argument"
        r, _ = await pool.call(broker, "pull", {"streamlets": [[1, 2]]}, timeout=5)
        assert r["errors"][0][2] == "invalid_argument"
    async with open_admin(coord) as a:
        with pytest.raises(UnknownStream):
            await a.describe_stream("nope")
        with pytest.raises(UnknownStream):
            await a.delete_stream("nope")
    # a record to a stream that does not exist: looked up with the others met, it fails
    with pytest.raises(ProduceError, match="1 records failed: unknown_stream"):
        async with open_producer(coord) as p:
            await p.send("nope", b"x")
    async with open_producer(coord) as p:
        with pytest.raises(UnknownStream):
            await p.load_metadata(["nope"])
    assert await stored(coord) == before


BAD_NAMES = ["", "x" * 300, "../x", "a/b", "bad\x00name", "tab\there", "new\nline", ".hidden", "sp ace",
             None, 42]


async def test_invalid_stream_names(cluster):
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        for name in BAD_NAMES:
            with pytest.raises(InvalidName):
                await a.create_stream(name)
        assert await a.list_streams() == []
        await a.create_stream("fine-name_1.0")
        assert [s.name for s in await a.list_streams()] == ["fine-name_1.0"]


async def test_invalid_stream_arguments(cluster):
    async with open_admin(cluster.coordinator) as a:
        for bad in ({"streamlets": 0}, {"streamlets": "4"}, {"groups": -1}, {"replication": 9},
                    {"vlogs": "bogus"}, {"segment_size": 10}):
            with pytest.raises(Exception) as e:
                await a.create_stream("x", **bad)
            assert e.value.code in ("invalid_argument", "limit_exceeded", "not_enough_backups"), bad
        assert await a.list_streams() == []


def test_struct_prefix_is_16_bytes():
    assert struct.calcsize("<2sBBIII") == frame.PREFIX_SIZE == 16


async def test_many_garbage_connections_at_once(cluster):
    coord = cluster.coordinator
    await setup_good(coord)

    async def junk(i):
        await trio.to_thread.run_sync(raw, coord, os.urandom(1000 + i))

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for i in range(50):
                n.start_soon(junk, i)
    async with open_admin(coord) as a:
        assert [s.name for s in await a.list_streams()] == ["good"]


async def test_memory_budget_refuses_with_a_typed_error(make_cluster):
    """Bounded resources: past its budget a broker refuses appends (typed), keeps what it has."""
    cluster = make_cluster(1, broker_args=["--memory", str(256 << 10)])
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        s = await a.create_stream("full", streamlets=1, replication=1, segment_size=64 << 10)
    with pytest.raises(ProduceError, match="broker_full"):
        async with open_producer(coord, **{"chunk.size": 8192}) as p:
            for _ in range(5000):
                await p.send("full", b"v" * 100)
    acked = p.acked
    assert 0 < acked < 5000
    async with open_pool() as pool:
        st, _ = await pool.call(s.addrs[0], "stats", {}, timeout=5)
    assert st["memory"] <= st["memory_limit"] == 256 << 10
    async with open_consumer(["full"], coord) as c:
        assert len(await read_values(c, acked)) == acked


async def test_bad_internal_requests_to_brokers_and_backups(cluster):
    """The servers' own RPCs (assign, recover, pend, replicate, replay) refuse malformed or misplaced
    requests with typed errors; the cluster keeps serving and nothing stored changes."""
    coord = cluster.coordinator
    s = await setup_good(coord)
    before = await stored(coord)
    async with open_admin(coord) as a:
        st = await a.status()
    broker = next(b for b in st["brokers"] if b["addr"] == s.addrs[0])
    backup = next(b for b in st["backups"] if b["alive"])
    async with open_members(cluster) as pool:
        async def code(addr, method, meta, payload=b""):
            with pytest.raises(KeraError) as e:
                await pool.call(addr, method, meta, payload, timeout=5)
            return e.value.code

        ep = broker["epoch"]
        assert await code(broker["addr"], "assign", {"epoch": ep, "streams": "x"}) == "invalid_argument"
        # a stream map that lacks a key or has one of the wrong type: refused before any is
        # assigned (the good entry before it names a stream this broker does not hold)
        wire = s.to_wire()
        fresh = {**wire, "id": wire["id"] + 10_000, "name": "not-assigned"}
        partial = {k: v for k, v in wire.items() if k != "groups"}
        assert await code(broker["addr"], "assign", {"epoch": ep, "streams": [[fresh, [0]], [partial, [0]]]}) \
            == "invalid_argument"
        held, _ = await pool.call(broker["addr"], "stats", {"streams": True}, timeout=5)
        assert wire["id"] in held["streams"] and fresh["id"] not in held["streams"]
        # a stream named by id (a recovery's hand-over) whose map this broker never had: refused
        # before any entry is placed, the map sent beside it included
        assert await code(broker["addr"], "assign", {"epoch": ep, "streams": [[fresh, [0]]],
                                                     "ids": [[fresh["id"] + 1, [0]]]}) == "invalid_argument"
        assert await code(broker["addr"], "assign", {"epoch": ep, "ids": [["1", [0]]]}) == "invalid_argument"
        held, _ = await pool.call(broker["addr"], "stats", {"streams": True}, timeout=5)
        assert fresh["id"] not in held["streams"] and fresh["id"] + 1 not in held["streams"]
        assert await code(broker["addr"], "configure", {"epoch": ep, "stream": {**wire, "id": "1"}}) \
            == "invalid_argument"
        assert await code(broker["addr"], "assign", {"epoch": ep, "stream": wire, "streamlets": [0],
                                                     "backups": [{"id": 1}]}) == "invalid_argument"
        assert await code(broker["addr"], "assign", {"epoch": ep + 1000, "stream": wire,
                                                     "streamlets": [0]}) == "fenced"
        # a replayed chunk for a streamlet that is not being recovered here
        assert await code(broker["addr"], "recover", {"epoch": ep},
                          chunk.build(s.id, 0, 999, 0, [b"x"])) == "not_owner"
        # groups pending a dead broker's adoption (kera.adoption): malformed, backwards, too
        # many, or one streamlet not held here after one that is: refused, none pending (the
        # stream is still read whole below)
        mine = [s.id, 0, [[5, 7]], [[3, 1]], [[0, 7]]]
        for bad in ({"source": [1], "entries": [mine]}, {"source": [1, 1], "entries": "x"},
                    {"source": [1, 1], "entries": [[s.id, 0, [[7, 5]], [], []]]},
                    {"source": [1, 1], "entries": [[s.id, 0, [[0, 1 << 21]], [], []]]},
                    {"source": [1, 1], "entries": [[s.id, 0, [[-1, 2]], [], []]]}):
            assert await code(broker["addr"], "pend", {"epoch": ep, **bad}) == "invalid_argument"
        assert await code(broker["addr"], "pend", {"epoch": ep, "source": [1, 1], "entries": [
            mine, [s.id + 10_000, 0, [[5, 7]], [], []]]}) == "not_owner"
        r, _ = await pool.call(broker["addr"], "pull", {"streamlets": [[s.id, 0, 0, {}]]}, timeout=5)
        assert not r["errors"], r   # read from its start: nothing pending
        # a replicate past a copy's end says the copy's length; one of garbage bytes is refused
        key = {"broker": 4242, "epoch": 1, "vlog": 1 << 32, "vseg": 0}
        with pytest.raises(KeraError) as e:
            await pool.call(backup["addr"], "replicate", {**key, "offset": 100}, b"", timeout=5)
        assert e.value.code == "backup" and e.value.length == 0
        assert await code(backup["addr"], "replicate", {**key, "offset": 0}, b"garbage") in (
            "invalid_argument", "checksum")
        # replays of a replica that is not there, or from an offset past its end, or without routes
        where = {k: key[k] for k in ("broker", "vlog", "vseg")}
        assert await code(backup["addr"], "replay", {**where, "owners": []}) == "backup"
        for b in st["backups"]:
            r, _ = await pool.call(b["addr"], "list", {}, timeout=5)
            if r["segments"]:
                holder, held = b["addr"], r["segments"][0]
        where = {k: held[k] for k in ("broker", "vlog", "vseg")}
        assert await code(holder, "replay", {**where, "owners": [],
                                             "offset": held["length"] + 1}) == "invalid_argument"
        assert await code(holder, "replay", {**where, "owners": "x"}) == "invalid_argument"
        assert await code(holder, "replay", {**where, "owners": []}, b"x" * 17) == "invalid_argument"
        assert await code(holder, "replay", {**where, "owners": []}, b"\0" * 16) == "invalid_argument"
    assert await stored(coord) == before
