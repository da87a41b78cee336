"""Many streams with traffic: metadata comes a page at a time whatever the number of streams,
a producer looks the streams it meets up together, and a pattern subscription reads many
streams through pull sessions."""

from __future__ import annotations

import math

import pytest
import trio
from kera_client import open_admin, open_consumer, open_producer

from kera.errors import Unavailable, UnknownStream
from kera.limits import MAX_LIST_PAGE, MAX_META

from .conftest import free_port
from .workload import create

BIG = 200_000


async def test_metadata_of_200k_streams_is_paged(make_cluster):
    """load_metadata, describe, a consumer's open and the Spark source's planning on 200,000
    streams: each answer is one page under the frame limits (one answer for them all would be
    about 40 MB, refused as FrameTooLarge)."""
    pytest.importorskip("kera_client.spark", reason="needs PySpark >= 4.2")
    from kera_client.spark.source import KeraBatchReader, ReadOptions

    cluster = make_cluster(1)
    coord = cluster.coordinator
    names = [f"m{i:06d}" for i in range(BIG)]
    assert BIG * 200 > MAX_META
    with trio.fail_after(240):
        await create(coord, names, replication=1)
        async with open_producer(coord) as p:
            await p.load_metadata(names)
            assert len(p.streams) == BIG and p.metadata_requests == math.ceil(BIG / MAX_LIST_PAGE)
            await p.send(names[-1], b"last")
        async with open_admin(coord) as a:
            assert list(await a.describe_streams(names)) == names
        async with open_consumer(names, coord) as c:
            assert len(c.positions) == BIG
            got = []
            while not got:
                got = [v for ch in await c.poll_chunks(1.0) for v in ch.values()]
            assert got == [b"last"]

        def plan():
            return KeraBatchReader(ReadOptions({"coordinator": coord, "pattern": "m*"})).partitions()
        parts = await trio.to_thread.run_sync(plan)
        assert [r[0] for p in parts for r in p.ranges] == [names[-1]]


async def test_a_producer_looks_new_streams_up_together(make_cluster):
    """One record to each of N streams it does not know: one metadata request per page of
    the streams met during a linger, not one per stream; records to a stream that does not
    exist fail with UnknownStream, the others are acknowledged."""
    cluster = make_cluster(1)
    coord = cluster.coordinator
    n = 3000
    names = [f"n{i:05d}" for i in range(n)]
    with trio.fail_after(60):
        await create(coord, [*names, "known"], replication=1)
        async with open_producer(coord, **{"linger.ms": 5}) as p:
            await p.load_metadata(["known"])
            assert p.metadata_requests == 1
            for s in names:
                await p.send(s, s.encode())
            known = await p.send("known", b"k", report=True)   # not held up by the lookups
            nope = await p.send("nope", b"x", report=True)
            await p.flush()
            assert (await known).stream == "known"
            with pytest.raises(UnknownStream):
                await nope
            assert p.acked == n + 1
            assert p.metadata_requests == 1 + math.ceil((n + 1) / MAX_LIST_PAGE)
        async with open_admin(coord) as a:   # a page stops where it is full: the rest is asked again
            r = await a.call("metadata", names=names[:8], limit=5)
            assert [s["name"] for s in r["streams"]] == names[:5] and r["more"] == 3


async def test_a_pattern_subscription_reads_one_record_of_each_of_many_streams(make_cluster):
    """A consumer subscribed by pattern reads one record of each of many streams (pull
    sessions on two brokers) while it is still learning them (the listing goes on after its
    first page), then the streams created after it subscribed (found as the streams created
    since its last look), and nothing twice."""
    cluster = make_cluster(2)
    coord = cluster.coordinator
    n = 5000
    names = [f"p-{i:05d}" for i in range(n)]
    later = [f"p-z{i:03d}" for i in range(50)]
    with trio.fail_after(120):
        await create(coord, [*names, "other"], replication=1)
        async with open_producer(coord) as p:
            for s in [*names, "other"]:
                await p.send(s, s.encode())
        async with open_consumer(None, coord, pattern="p-*") as c:
            assert MAX_LIST_PAGE <= len(c.streams) < n and not c._listed   # the first pages only
            got = []
            while len(got) < n:
                got += [v for ch in await c.poll_chunks(1.0) for v in ch.values()]
            assert sorted(got) == [s.encode() for s in names] and c._listed
            assert len(c.sessions.links) == 2 and all(link.session for link in c.sessions.links.values())
            assert await c.poll_chunks(0.3) == []
            await create(coord, later, replication=1)
            async with open_producer(coord) as p:
                for s in later + names[:3]:
                    await p.send(s, b"again " + s.encode())
            more = []
            while len(more) < len(later) + 3:
                more += [v for ch in await c.poll_chunks(1.0) for v in ch.values()]
            assert sorted(more) == sorted(b"again " + s.encode() for s in later + names[:3])
            assert len(c.positions) == n + len(later)



async def test_a_listing_that_fails_after_its_first_page_is_told_by_the_next_poll(make_cluster):
    """The coordinator dies while a consumer opened on a pattern is still listing (past its
    first page): the next poll raises the listing's error, the consumer keeps reading what it
    learnt, and once the coordinator is back the poll after lists again and every stream is
    read, none twice."""
    cluster = make_cluster(1, port=free_port())   # restarted where the consumer looks for it
    coord = cluster.coordinator
    n = 20 * MAX_LIST_PAGE
    names = [f"l-{i:05d}" for i in range(n)]
    with trio.fail_after(180):
        await create(coord, names, replication=1)
        async with open_producer(coord) as p:
            for s in names:
                await p.send(s, s.encode())
        async with open_consumer(None, coord, pattern="l-*") as c:
            assert not c._listed and len(c.streams) < n   # past its first page, not done
            cluster.kill("coordinator")
            got = []
            with pytest.raises(Unavailable):
                while True:   # reads what it learnt until the listing's error is told
                    got += [v for ch in await c.poll_chunks(0.5) for v in ch.values()]
            learnt = len(c.streams)
            assert c._listed and learnt < n and len(got) <= learnt
            cluster.restart("coordinator")
            while len(got) < n:
                got += [v for ch in await c.poll_chunks(1.0) for v in ch.values()]
            assert sorted(got) == [s.encode() for s in names] and len(c.streams) == n


def test_a_pull_session_reads_what_moved_or_was_touched():
    """Sans-IO: a streamlet is ready once added, moved or touched, and leaves the ready set
    when taken; a dropped one is never read; an unknown session, or one another principal
    opened, is a typed error."""
    from kera.broker.pull_sessions import PullSessions
    from kera.errors import UnknownSession
    from kera.limits import MAX_PULL_SESSIONS

    sessions = PullSessions()
    s = sessions.open("User:alice")
    s.set((1, 0), 0, {})
    s.set((2, 0), 0, {0: 5})
    s.set((1, 0), 0, {0: 7})   # moved again before it was read: ready once
    assert [s.take(), s.take(), s.take()] == [(1, 0), (2, 0), None]
    assert s.positions[(1, 0)] == (0, {0: 7})
    sessions.touch([(2, 0), (9, 0)])   # newly durable chunks: only what it reads
    s.drop((1, 0))
    sessions.touch([(1, 0)])
    assert [s.take(), s.take()] == [(2, 0), None]
    assert sessions.get(s.id, "User:alice") is s
    with pytest.raises(UnknownSession):
        sessions.get(s.id + 1, "User:alice")
    with pytest.raises(UnknownSession):
        sessions.get(s.id, "User:mallory")
    assert set(sessions.readers) == {(2, 0)}   # who reads what: (1, 0) was dropped
    for _ in range(MAX_PULL_SESSIONS):   # the least recently used goes, with what it read
        sessions.open("User:alice")
    assert sessions.readers == {} and len(sessions.by_id) == MAX_PULL_SESSIONS
