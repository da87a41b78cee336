"""Verifiable synthetic records: each value carries (producer, counter) so a
consumer can check exactly-once delivery and per-producer order with numpy."""

from __future__ import annotations

import time

import numpy as np
import trio
from kera_client import open_admin, open_consumer, open_producer

from kera.errors import Unavailable
from kera.position import DONE

SIZE = 100


def values(producer: int, start: int, n: int, size: int = SIZE) -> np.ndarray:
    arr = np.full((n, size), ord("x"), dtype=np.uint8)
    arr[:, 0:4] = np.frombuffer(np.uint32(producer).tobytes(), np.uint8)
    arr[:, 4:12] = np.arange(start, start + n, dtype="<u8").view(np.uint8).reshape(n, 8)
    return arr


def decode(chunk, size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(producer ids, counters) of a received chunk's fixed-size values, no per-record loop."""
    data = np.frombuffer(chunk.view.value_data, np.uint8).reshape(-1, size)
    return data[:, 0:4].copy().view("<u4").ravel(), data[:, 4:12].copy().view("<u8").ravel()


class Ledger:
    """What a consumer saw, per (stream, streamlet, producer): counters in arrival order."""

    def __init__(self):
        self.seen: dict[tuple, list[np.ndarray]] = {}
        self.records = 0

    def add(self, chunk) -> None:
        producers, counters = decode(chunk)
        p = int(producers[0])
        assert (producers == p).all(), "a chunk holds one producer's records"
        self.seen.setdefault((chunk.stream, chunk.streamlet, p), []).append(counters)
        self.records += len(counters)

    def check(self, expected: dict[tuple, int]) -> None:
        """Every (stream, producer) got counters 0..n-1 exactly once, in order per streamlet."""
        per_stream: dict[tuple, list[np.ndarray]] = {}
        for (stream, streamlet, p), parts in self.seen.items():
            arr = np.concatenate(parts)
            assert (np.diff(arr.astype(np.int64)) > 0).all(), \
                f"out of order or repeated on {stream}/{streamlet} for producer {p}"
            per_stream.setdefault((stream, p), []).append(arr)
        assert set(per_stream) == set(expected), "streams/producers differ from what was sent"
        for key, parts in per_stream.items():
            got = np.sort(np.concatenate(parts))
            n = expected[key]
            assert len(got) == n and (got == np.arange(n)).all(), f"{key}: {len(got)} of {n} records"


async def produce_all(coord, streams, producers, per_pair, rounds, halfway=None, **opts):
    """Proxy producers: each writes to every stream, a slice per round; ``halfway``, if
    given, is awaited by each producer before its second half of the rounds."""
    async def one(p):
        async with open_producer(coord, **opts) as prod:
            await prod.load_metadata(streams)
            sent = 0
            for r in range(rounds):
                if halfway is not None and r == rounds // 2:
                    await halfway()
                n = per_pair // rounds + (r < per_pair % rounds)
                for s in streams:
                    await prod.send_many(s, values(p, sent, n))
                sent += n
            await prod.flush()
            assert prod.acked == per_pair * len(streams)

    async with trio.open_nursery() as nursery:
        for p in range(producers):
            nursery.start_soon(one, p)


async def consume_all(coord, streams, total, idle=15.0, **kw) -> Ledger:
    """Poll until ``total`` records arrived; ``idle`` seconds without any is only a hang
    guard (an empty poll is not the end), so the caller must assert what it got."""
    ledger = Ledger()
    async with open_consumer(streams, coord, **kw) as c:
        idle_until = trio.current_time() + idle
        while ledger.records < total and trio.current_time() < idle_until:
            chunks = await c.poll_chunks(1.0)
            if chunks:
                idle_until = trio.current_time() + idle
            for ch in chunks:
                ledger.add(ch)
    return ledger


def reached(position: dict, end: dict) -> bool:
    """A reader's ``position()`` is at or past ``end`` (a ``position()`` from 'latest') in
    every group of every streamlet: a group it finished, left, or read up to there. A group
    finished at ``end`` that the reader never saw counts as left once the reader holds a later
    group: a broker serves groups in id order, and a finished group freed meanwhile (compacted
    away) is never reported to anyone."""
    for key, e in end.items():
        p = position.get(key, {"low": 0, "groups": {}})
        later = max(map(int, p["groups"]), default=-1)
        for g, stop in e["groups"].items():
            at = p["groups"].get(g)
            if int(g) < p["low"] or at == DONE:
                continue
            if at is None and stop == DONE and later > int(g):
                continue
            if stop == DONE or (at or 0) < stop:
                return False
    return True


async def read_to_end(coord, streams, **kw) -> list:
    """Every chunk from earliest up to the streams' durable end when called (taken from a
    reader starting 'latest'): an empty poll is never taken for the end."""
    async with open_consumer(streams, coord, start="latest") as c:
        end = c.position()
    got: list = []
    async with open_consumer(streams, coord, start="earliest", **kw) as c:
        while not reached(c.position(), end):
            got += await c.poll_chunks(1.0)
    return got


async def read_values(consumer, want: int, timeout: float = 30.0, surplus: float = 0.3) -> list:
    """Values polled until ``want`` arrived (``timeout`` is a hang guard), then whatever
    more shows up within ``surplus``: an empty poll on a loaded machine is not the end,
    and a count past ``want`` must stay visible to the caller's assertion."""
    got: list = []
    with trio.move_on_after(timeout):
        while len(got) < want:
            got += [v for ch in await consumer.poll_chunks(1.0) for v in ch.values()]
    got += [v for ch in await consumer.poll_chunks(surplus) for v in ch.values()]
    return got


async def stream_values(coord, stream: str, want: int, **kw) -> list:
    """``stream``'s values from earliest: ``want`` of them, and any surplus (``read_values``)."""
    async with open_consumer([stream], coord, **kw) as c:
        return await read_values(c, want)


async def create(coord, streams, **kw) -> None:
    """The streams, all with the same options, in batch requests."""
    async with open_admin(coord) as a:
        await a.create_streams(list(streams), **kw)


async def send_and_flush(coord, streams, producer: int, n: int) -> None:
    """``n`` records with counters 0..n-1 of value-producer ``producer`` to each stream, all acked."""
    async with open_producer(coord, **{"linger.ms": 2}) as prod:
        await prod.load_metadata(streams)
        for s in streams:
            await prod.send_many(s, values(producer, 0, n))
        await prod.flush()
        assert prod.acked == n * len(streams)


async def status(coord) -> dict:
    """The coordinator's status, once it answers (it refuses while down or starting)."""
    while True:
        try:
            async with open_admin(coord) as a:
                return await a.status()
        except Unavailable:
            await trio.sleep(0.1)


async def producer_id(coord) -> dict:
    """A producer id issued to this (anonymous) client, and its token: the meta of a produce
    request sent by hand (``{"producer": id, "token": token}``)."""
    async with open_admin(coord) as a:
        r = await a.call("producer_id")
    return {"producer": r["id"], "token": r["token"]}


class TimedIngest:
    """Batches sent and flushed one after another, until stopped: the longest flush is the
    longest produce stall. The values carry producer ``who`` and counters 0, 1, ... per stream."""

    def __init__(self, coord, streams, batch: int = 20, who: int = 1):
        self.coord, self.streams, self.batch, self.who = coord, streams, batch, who
        self.sent = 0
        self.longest = 0.0
        self.stop = trio.Event()
        self.acked = trio.Event()   # set after each acknowledged batch

    async def run(self) -> None:
        async with open_producer(self.coord, **{"linger.ms": 2}) as prod:
            await prod.load_metadata(self.streams)
            while not self.stop.is_set():
                t0 = time.monotonic()
                for s in self.streams:
                    await prod.send_many(s, values(self.who, self.sent, self.batch))
                await prod.flush()
                self.longest = max(self.longest, time.monotonic() - t0)
                self.sent += self.batch
                self.acked.set()
                self.acked = trio.Event()
            assert prod.acked == self.sent * len(self.streams)

    async def more(self, batches: int = 5) -> None:
        """Until ``batches`` more batches were acknowledged."""
        for _ in range(batches):
            await self.acked.wait()
