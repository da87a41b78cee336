"""Sequences after a give-up, and duplicates acknowledged only when durable.

A producer that gives up on chunks of a streamlet (delivery timeout, a refused
chunk) flags the next chunk it sends with SEQ_RESET; the broker takes that
sequence as the producer's new base, and any older sequence (a late copy of a
chunk given up on) as a duplicate, never stored. A duplicate is acknowledged
once every vlog the producer's chunks went to is durable up to them, not only
the vlog of its newest chunk.
"""

from __future__ import annotations

import signal
import time

import pytest
import trio
from kera_client import ProduceError, open_admin, open_producer

from kera import chunk
from kera.broker.streamlet import Streamlet
from kera.errors import OutOfOrderSequence
from kera.rpc import open_pool

from .conftest import stream_meta
from .workload import producer_id, stream_values


def streamlet(segment_size: int = 4096, group_segments: int = 1) -> Streamlet:
    return Streamlet(stream_meta(segment_size=segment_size, group_segments=group_segments), 0)


def offer(sl: Streamlet, seq: int, vlog="v", flags: int = 0, size: int = 8) -> str:
    """What the broker does with a chunk: 'dup' (acknowledged again) or 'new' (appended)."""
    if sl.check_sequence(7, seq, flags & chunk.SEQ_RESET) is not None:
        return "dup"
    c = chunk.build(1, 0, 7, seq, [b"x" * size], flags=flags)
    g, seg, off = sl.append(c, 7)
    sl.note_producer(7, seq, vlog, seg.head, seg, off + len(c))
    return "new"


def test_reset_is_a_new_base_and_older_sequences_are_duplicates():
    sl = streamlet()
    assert offer(sl, 0) == "new"
    with pytest.raises(OutOfOrderSequence):
        offer(sl, 3)                               # 1 and 2 were given up: a hole
    assert offer(sl, 3, flags=chunk.SEQ_RESET) == "new"
    assert offer(sl, 1) == "dup"                   # a late copy of a chunk given up on
    assert offer(sl, 2, flags=chunk.SEQ_RESET) == "dup"
    assert offer(sl, 3, flags=chunk.SEQ_RESET) == "dup"  # the reset chunk resent
    assert offer(sl, 4) == "new"
    assert sl.appended_chunks == 3


def test_flag_survives_in_the_header():
    c = chunk.build(1, 0, 7, 5, [b"v"])
    assert chunk.parse_header(c).flags == 0
    r = chunk.with_flags(c, chunk.SEQ_RESET)
    h = chunk.verify(r)
    assert h.flags == chunk.SEQ_RESET and h.sequence == 5 and r[chunk.HEADER_SIZE:] == c[chunk.HEADER_SIZE:]


def test_duplicate_waits_for_every_vlog_its_producer_used():
    """Each group has one segment of room for one chunk: every chunk opens a group, and
    groups change vlogs. A resend of the first chunk must wait for its own vlog."""
    sl = streamlet(segment_size=4096, group_segments=1)
    placed = []
    for seq in range(3):
        g_before = set(sl.groups)
        assert offer(sl, seq, vlog=f"vlog{seq}", size=3000) == "new"
        (gid,) = set(sl.groups) - g_before
        seg = sl.groups[gid].segments[0]
        placed.append((f"vlog{seq}", seg))
    st = sl.check_sequence(7, 0)
    assert st is not None
    assert sorted(st.waits()) == [(v, seg.head) for v, seg in placed]  # not only the newest
    for _, seg in placed[:2]:
        seg.durable = seg.head
    assert st.waits() == [("vlog2", placed[2][1].head)]
    # a new vlog: the ones already durable are forgotten
    assert offer(sl, 3, vlog="vlog3", size=3000) == "new"
    assert st.refs[::4] == ["vlog2", "vlog3"]


def test_recovery_replay_notes_producers_in_any_order():
    """rpc_recover's call (no segment): the highest sequence wins, every vlog is kept."""
    sl = streamlet()
    sl.note_producer(7, 5, "a", 10)
    sl.note_producer(7, 3, "b", 4)
    sl.note_producer(7, 4, "a", 8)
    st = sl.producer(7)
    assert st.last_seq == 5 and sorted(st.waits()) == [("a", 10), ("b", 4)]
    assert sl.tails == ["a", 8, "b", 4]   # each vlog's last chunk noted: a tail's barrier
    assert sl.producers is st and sl.producer(9) is None   # one producer: its state alone
    sl.note_producer(9, 0, "a", 11)
    sl.note_adopted({9: 2, 11: 4})
    assert sl.producers == {7: st, 9: sl.producer(9), 11: sl.producer(11)}
    assert (sl.producer(9).last_seq, sl.producer(11).last_seq, sl.producer(7).last_seq) == (2, 4, 5)
    assert sl.tails == ["a", 11, "b", 4] and sl.producer(8) is None


# -- real processes -----------------------------------------------------------------------


async def poll(cond) -> None:
    while not cond():
        await trio.sleep(0.02)


async def test_broker_takes_a_reset_and_never_stores_a_late_copy(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        s = await a.create_stream("rs", replication=1)
    sid, broker = s.id, s.addrs[0]

    mine = await producer_id(coord)

    def c(seq, flags=0):
        return chunk.build(sid, 0, mine["producer"], seq, [b"seq%d" % seq], flags=flags)

    with trio.fail_after(60):
        async with open_pool() as pool:
            async def produce(*chunks):
                r, _ = await pool.call(broker, "produce", mine, parts=list(chunks), timeout=10)
                return r["errors"]

            assert await produce(c(0)) == []
            assert await produce(c(3)) == [[0, "out_of_order_sequence"]]
            assert await produce(c(3, chunk.SEQ_RESET), c(4)) == []
            assert await produce(c(1), c(2)) == []             # late copies: acknowledged, not stored
            assert await produce(c(3, chunk.SEQ_RESET)) == []  # the reset chunk resent
            assert await produce(c(5)) == []
        assert await stream_values(coord, "rs", 4) == [b"seq0", b"seq3", b"seq4", b"seq5"]


async def test_producer_resyncs_after_a_delivery_timeout(make_cluster):
    """Chunks queued behind a request to a paused broker expire unsent: the broker never
    sees their sequences. The next chunk carries SEQ_RESET, so what follows is
    acknowledged (before: out of order until it expired too, and so on forever)."""
    cluster = make_cluster(1, coordinator_args=["--dead-after", "20"])  # no failover during the pause
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        await a.create_stream("rs", replication=1)
    opts = {"chunk.size": 1, "linger.ms": 0, "delivery.timeout.ms": 2500, "request.timeout.ms": 20_000}
    stopped = False
    with trio.fail_after(90):
        try:
            # leaving the producer flushes: it reports the two records given up, only those
            with pytest.raises(ProduceError, match="2 records failed: delivery timeout"):
                async with open_producer(coord, **opts) as p:
                    await p.send("rs", b"v0")
                    await p.flush()
                    lane = p.streams["rs"].lanes[0]
                    cluster.kill("node1-broker", signal.SIGSTOP)
                    stopped = True
                    await p.send("rs", b"v1")                   # in a request the broker does not read yet
                    await poll(lambda: lane.busy)
                    await p.send("rs", b"v2")                   # queued behind it ...
                    await p.send("rs", b"v3")
                    assert len(lane.queue) == 2
                    # ... until they are past their delivery timeout, never sent
                    await poll(lambda: all(time.monotonic() - c.created > p.lookups.delivery_timeout
                                           for c in lane.queue))
                    cluster.kill("node1-broker", signal.SIGCONT)
                    stopped = False
                    await poll(lambda: p.acked == 2 and p.failed == 2)  # v1 acknowledged, v2 and v3 not
                    for i in range(4, 14):
                        await p.send("rs", b"v%d" % i)
                    await poll(lambda: p.outstanding == 0)
                    assert p.acked == 12 and p.failed == 2
        finally:
            if stopped:
                cluster.kill("node1-broker", signal.SIGCONT)
        want = [b"v0", b"v1"] + [b"v%d" % i for i in range(4, 14)]
        assert await stream_values(coord, "rs", len(want)) == want


async def test_a_lingering_chunk_grows_while_its_streamlet_is_in_a_request(make_cluster):
    """A chunk whose linger ran out while its streamlet waits for an answer stays open (it
    could only queue sealed behind that request) and takes the records that follow, so
    under load chunks grow instead of carrying one record each; it is sealed, and sent,
    once the answer comes, and the records arrive in order."""
    cluster = make_cluster(1, coordinator_args=["--dead-after", "20"])  # no failover during the pause
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        await a.create_stream("lg", replication=1)
    stopped = False
    with trio.fail_after(60):
        try:
            async with open_producer(coord, **{"chunk.size": 16384, "linger.ms": 1}) as p:
                await p.send("lg", b"v0")
                await p.flush()
                lane = p.streams["lg"].lanes[0]
                cluster.kill("node1-broker", signal.SIGSTOP)
                stopped = True
                await p.send("lg", b"v1")
                await poll(lambda: lane.busy)    # v1's chunk in a request not answered yet
                for i in (2, 3, 4):
                    await p.send("lg", b"v%d" % i)
                await poll(lambda: lane.due is not None)    # their linger is over: still open, not queued
                assert lane.open.values == [b"v2", b"v3", b"v4"] and not lane.queue
                await p.send("lg", b"v5")
                cluster.kill("node1-broker", signal.SIGCONT)
                stopped = False
                await poll(lambda: p.outstanding == 0)
                assert p.acked == 6 and p.failed == 0
        finally:
            if stopped:
                cluster.kill("node1-broker", signal.SIGCONT)
    assert await stream_values(coord, "lg", 6) == [b"v%d" % i for i in range(6)]


async def test_keyed_and_keyless_records_on_one_stream_all_arrive(make_cluster):
    """Round-robin may put a keyless record on a streamlet where a keyed chunk is open: that
    chunk leaves first instead of being replaced (and lost, with flush waiting forever)."""
    cluster = make_cluster(1)
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        await a.create_stream("mixed", streamlets=2, replication=1)
    want = []
    with trio.fail_after(60):
        async with open_producer(coord, **{"linger.ms": 1000}) as p:
            for i in range(20):
                await p.send("mixed", b"k%d" % i, key=b"key%d" % (i % 3))
                await p.send("mixed", b"n%d" % i)
                want += [b"k%d" % i, b"n%d" % i]
            await p.flush()
            assert p.acked == 40 and p.failed == 0
        assert sorted(await stream_values(coord, "mixed", 40)) == sorted(want)
