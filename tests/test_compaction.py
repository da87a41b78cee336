"""Key compaction: the chunk rewrite, the pure pass, and a compacted stream on a real cluster."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from kera_client import ProduceError, open_admin, open_consumer, open_producer

from kera import chunk
from kera.broker.compactor import compact, key_ids
from kera.broker.segment import Segment
from kera.broker.streamlet import Streamlet
from kera.errors import KeraError

from .conftest import stream_meta
from .workload import read_to_end

KEYS, ROUNDS = 1000, 100


# -- the pure parts ------------------------------------------------------------------------
def _segment(chunks: list[bytes], sid: int = 0) -> tuple[Segment, memoryview]:
    seg = Segment(sid, 1 << 16)
    for c in chunks:
        off = seg.append(c)
        chunk.place(seg.view, off, 0, sid, off)
    seg.durable = seg.head
    return seg, seg.view[:seg.head]


def _records(data) -> list:
    return [r[:2] for h, off in chunk.scan(data) for r in chunk.ChunkView(data, off, h).records()]


def test_rewrite_keeps_placement_and_original_indices():
    c = chunk.build(7, 0, 3, 5, [b"a1", b"b1", b"a2", b""], [b"a", b"b", b"a", b"c"])
    buf = bytearray(c)
    chunk.place(buf, 0, 2, 4, 96)
    v = chunk.ChunkView(bytes(buf))
    out = chunk.rewrite(v, np.array([1, 2]))
    h = chunk.verify(out)
    assert (h.group, h.segment, h.offset, h.producer_id, h.sequence) == (2, 4, 96, 3, 5)
    assert h.flags & chunk.COMPACTED and h.record_count == 2
    w = chunk.ChunkView(out)
    assert w.keys() == [b"b", b"a"] and w.values() == [b"b1", b"a2"]
    assert chunk.original_indices(w).tolist() == [1, 2]
    # a group that consumed the first record of the original skips none of the survivors;
    # one that consumed two skips b1; and back: one survivor read covers two originals
    assert [chunk.skip_in(w, k) for k in (0, 1, 2, 3, 4)] == [0, 0, 1, 2, 2]
    assert [chunk.skip_out(w, s) for s in (0, 1, 2)] == [0, 2, 3]
    again = chunk.ChunkView(chunk.rewrite(w, np.array([1])))   # compacted twice: still original
    assert chunk.original_indices(again).tolist() == [2] and again.values() == [b"a2"]


def test_key_ids_are_exact_for_short_and_long_keys():
    keys = [b"", b"a", b"a\x00", b"b", b"a", b"", b"x" * 100, b"x" * 99 + b"y", b"x" * 100]
    for ks in (keys[:6], keys):
        data = np.frombuffer(b"".join(ks), np.uint8)
        lens = np.array([len(k) for k in ks], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        ids = key_ids(data, starts, lens)
        for i, a in enumerate(ks):
            for j, b in enumerate(ks):
                assert (ids[i] == ids[j]) == (a == b)


def test_a_pass_keeps_the_latest_per_key_and_positions():
    t = int(time.time() * 1000)
    c1 = chunk.build(1, 0, 1, 0, [b"a1", b"b1", b"c1"], [b"a", b"b", b"c"], t - 10_000)
    c2 = chunk.build(1, 0, 1, 1, [b"x", b"y"], [None, None], t)        # no key: always kept
    c3 = chunk.build(1, 0, 1, 2, [b"a2", b"", b"d1"], [b"a", b"c", b"d"], t - 10_000)  # c: tombstone
    c4 = chunk.build(1, 0, 1, 3, [b"d2"], [b"d"], t)
    s0, d0 = _segment([c1, c2])
    s1, d1 = _segment([c3, c4], 1)
    out, due = compact([(s0, d0), (s1, d1)], t, 60_000, True)
    assert _records(out[s0].buf) == [(b"b", b"b1"), (None, b"x"), (None, b"y")]
    assert _records(out[s1].buf) == [(b"a", b"a2"), (b"c", b""), (b"d", b"d2")]
    assert due == t - 10_000 + 60_000          # the tombstone's expiry
    # positions: every surviving chunk where it was; a position of a dropped chunk maps forward
    assert out[s0].starts == [0, len(c1)]
    assert out[s1].span(0, 1 << 20, s1.head)[0] == 0
    assert s1.head == len(c3) + len(c4)
    # the tombstone goes once delete.retention.ms passed, with the values it superseded
    out, due = compact([(s0, d0), (s1, d1)], t, 5_000, True)
    assert _records(out[s1].buf) == [(b"a", b"a2"), (b"d", b"d2")] and due is None
    # nothing to drop: no rewrite
    lone, dl = _segment([c4], 2)
    assert compact([(lone, dl)], t, 5_000, True) == ({}, None)


def test_retention_expires_only_streams_whose_policy_says_delete():
    """compact alone keeps every key's latest record whatever retention says (Kafka's
    meaning); compact,delete and delete expire by retention.bytes / retention.ms."""
    for policy, kept in (("compact", True), ("compact,delete", False), ("delete", False)):
        sl = Streamlet(stream_meta(retention_bytes=100, retention_ms=1, cleanup_policy=policy), 0)
        assert ((sl.retention_bytes, sl.retention_ms) == (-1, -1)) is kept, policy


def test_a_compacted_segment_serves_reads_at_original_positions():
    cs = [chunk.build(1, 0, 1, i, [b"v%d" % i], [b"k" if i < 3 else b"j%d" % i]) for i in range(5)]
    seg, data = _segment(cs)
    out, _ = compact([(seg, data)], 0, 1, True)
    seg.compacted = out[seg]
    ends = np.cumsum([len(c) for c in cs]).tolist()
    # chunks 0 and 1 were superseded by chunk 2: a reader at 0 or inside them starts at chunk 2
    for pos in (0, ends[0], ends[0] + 8):
        start, n, end = seg.span(pos, 1 << 20)
        assert start == ends[1] and end == seg.head and n == len(out[seg].buf)
    start, n, end = seg.span(ends[1], len(cs[2]))     # one chunk's worth
    assert (start, end) == (ends[1], ends[2])
    assert chunk.verify(bytes(seg.part(start, n))).offset == ends[1]
    assert seg.span(seg.head, 1 << 20) == (seg.head, 0, seg.head)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([b"", b"a", b"b", b"ab", b"a\x00", b"x" * 70]),
                                   st.sampled_from([b"", b"1", b"22"]), st.booleans()),
                         min_size=1, max_size=6), min_size=1, max_size=8),
       st.integers(1, 3), st.booleans())
def test_a_pass_agrees_with_a_per_record_model(chunks, per_segment, drop):
    """Against the obvious loop: a record stays iff it has no key, or it is its key's last and
    not a tombstone past its retention; chunks keep their placement; twice changes nothing."""
    now = 1_000_000
    built, model = [], []
    for i, recs in enumerate(chunks):
        ts = [now - (50 if old else 0) for _, _, old in recs]
        built.append(chunk.build(1, 0, 1, i, [v for _, v, _ in recs], [k for k, _, _ in recs], ts))
        model += [(i, j, k, v, t) for j, ((k, v, _), t) in enumerate(zip(recs, ts, strict=True))]
    last = {k: n for n, (_, _, k, _, _) in enumerate(model) if k}
    want = [(i, j) for n, (i, j, k, v, t) in enumerate(model)
            if not k or (last[k] == n and not (drop and v == b"" and t <= now - 10))]
    segs = [_segment(built[a:a + per_segment], a) for a in range(0, len(built), per_segment)]
    out, _ = compact(segs, now, 10, drop)
    got = []
    for seg, data in segs:
        held = out[seg].buf if seg in out else data
        for h, off in chunk.scan(held):
            view = chunk.ChunkView(held, off, h)
            i = next(n for n, c in enumerate(built) if h.sequence == n)
            assert h.offset == [0, *np.cumsum([len(c) for c in built[seg.id:i]]).tolist()][-1] \
                and h.segment == seg.id
            got += [(i, int(j)) for j in chunk.original_indices(view)]
    assert got == want
    again = [(s, out[s].buf if s in out else d) for s, d in segs]
    assert compact(again, now, 10, drop)[0] == {}


# -- a compacted stream on a real cluster ---------------------------------------------------
async def _read_all(coord: str, name: str) -> list:
    """(key, value) of every record from earliest to the stream's durable end."""
    return [kv for ch in await read_to_end(coord, [name])
            for kv in zip(ch.keys(), ch.values(), strict=True)]


def _latest(pairs) -> dict:
    return dict(pairs)


async def _produce(coord: str, name: str, rounds: range, value=lambda r: b"r%d" % r) -> None:
    keys = [b"k%d" % k for k in range(KEYS)]
    async with open_producer(coord, **{"linger.ms": 5}) as p:
        await p.load_metadata([name])
        for r in rounds:
            await p.send_many(name, [value(r)] * KEYS, keys)
        await p.flush()
        assert p.acked == KEYS * len(rounds)


async def _compacted(coord: str, name: str, want: dict, most: int, timeout: float = 90.0) -> list:
    """Read until the stream holds at most ``most`` records whose latest values are ``want``."""
    with trio.fail_after(timeout):
        while True:
            got = await _read_all(coord, name)
            if len(got) <= most and _latest(got) == want:
                return got


async def test_compacted_stream_keeps_latest_values_through_readers_and_a_broker_kill(make_cluster):
    """Acceptance (issue 13, 1): 1,000 keys written 100 times; after compaction at most 2,000
    records, every latest value; a reader during compaction misses none; tombstones go after
    delete.retention.ms; a broker kill gives back the compacted state or the original."""
    cluster = make_cluster(3)
    coord = cluster.coordinator
    want = {b"k%d" % k: b"r%d" % (ROUNDS - 1) for k in range(KEYS)}
    async with open_admin(coord) as adm:
        s = await adm.create_stream("c", replication=3, segment_size=64 << 10, group_segments=4,
                                    cleanup_policy="compact", segment_ms=500)
        assert (s.cleanup_policy, s.segment_ms) == ("compact", 500)
        for bad in ({"cleanup_policy": "shrink"}, {"cleanup.policy": 3}, {"delete_retention_ms": -5},
                    {"segment.ms": "soon"}, {"cleanup_policy": "compact", "groups": 2}):
            with pytest.raises(KeraError) as e:
                await adm.create_stream("bad", **bad)
            assert e.value.code == "invalid_argument"
        with pytest.raises(KeraError):
            await adm.alter_stream("c", cleanup_policy="shrink")
        await adm.create_stream("q", groups=2)
        with pytest.raises(KeraError, match="groups=1"):
            await adm.alter_stream("q", cleanup_policy="compact")
        assert (await adm.describe_stream("q")).cleanup_policy == "delete"
        assert (await adm.describe_stream("c")).cleanup_policy == "compact"

    with trio.fail_after(120):
        seen: dict = {}
        compacted = trio.Event()

        async def reader():
            """From earliest while records arrive and compaction runs; a third of the way in it
            waits until the segments it is positioned in were compacted, then reads on: it
            must see every key's latest value."""
            async with open_consumer(["c"], coord, start="earliest", max_bytes=16 << 10) as c:
                while seen != want:
                    for ch in await c.poll_chunks(1.0):
                        seen.update(zip(ch.keys(), ch.values(), strict=True))
                    if c.records_read >= KEYS * ROUNDS // 3 and not compacted.is_set():
                        await compacted.wait()

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await _produce(coord, "c", range(ROUNDS))
            got = await _compacted(coord, "c", want, 2 * KEYS)
            compacted.set()
        assert len(got) <= 2 * KEYS
        # segments left without a record are freed: their vsegs' floors move, backups delete files
        async with open_admin(coord) as adm:
            while sum(b.get("reclaimed_bytes", 0) for b in await adm.backup_stats()) == 0:
                await trio.sleep(0.2)
            freed = sum(b["freed_segments"] for b in await adm.broker_stats())
            assert freed > 0

        # tombstones: kept while delete.retention.ms runs, then gone with their keys
        # through the CLI: kera stream alter, and tombstones as key<TAB> lines
        env = {**os.environ, "KERA_COORDINATOR": coord}
        out = await trio.run_process([sys.executable, "-m", "kera", "stream", "alter", "c",
                                      "--delete-retention-ms", "2000"], capture_stdout=True, env=env)
        assert "cleanup.policy=compact" in out.stdout.decode()
        await trio.run_process([sys.executable, "-m", "kera", "produce", "c", "--keyed"], env=env,
                               stdin=b"".join(b"k%d\t\n" % k for k in range(100)), capture_stdout=True)
        gone = {k: v for k, v in want.items() if int(k[1:]) >= 100}
        await _compacted(coord, "c", {**gone, **{b"k%d" % k: b"" for k in range(100)}}, 2 * KEYS, 30)
        got = await _compacted(coord, "c", gone, 2 * KEYS, 60)
        assert not any(int(k[1:]) < 100 for k, _ in got)

    # kill -9 the owner: recovery replays the originals; they hold every latest value, and
    # the new owner compacts them again
    async with open_admin(coord) as adm:
        owner = (await adm.describe_stream("c")).addrs[0]
    cluster.kill(next(n for n, a in cluster.addrs.items() if a == owner))
    with trio.fail_after(120):
        while True:
            try:
                got = await _read_all(coord, "c")
            except KeraError:
                continue
            if got:   # a streamlet being recovered serves nothing; once it serves, all of it
                latest = _latest(got)
                assert all(latest.get(k) == v for k, v in gone.items())
                assert all(latest.get(b"k%d" % k, b"") == b"" for k in range(100))
                if len(got) <= 2 * KEYS and latest == gone:
                    break


async def test_a_compacted_stream_past_the_budget_is_refused_not_evicted(make_cluster):
    """Compacted segments are not evicted: once live keys outgrow a broker's budget, new
    segments are refused with broker_full; what was acknowledged
    stays readable."""
    cluster = make_cluster(1, broker_args=["--memory", str(512 << 10)])
    coord = cluster.coordinator
    async with open_admin(coord) as adm:
        await adm.create_stream("u", replication=1, segment_size=64 << 10, cleanup_policy="compact")
    with trio.fail_after(60):
        acked = 0
        with pytest.raises(ProduceError, match="broker_full"):
            async with open_producer(coord, **{"linger.ms": 5}) as p:
                for r in range(40):   # unique keys: compaction keeps every one
                    await p.send_many("u", [b"v" * 100] * 200, [b"u%d-%d" % (r, i) for i in range(200)])
                    await p.flush()
                    acked = p.acked
        assert 0 < acked < 40 * 200
        got = await _read_all(coord, "u")
        assert len(got) >= acked and len(set(k for k, _ in got)) == len(got)
