"""Faults a storage engine must shrug off, with real processes and signals.

Each test ends the same way: every acknowledged record is read back exactly
once, and new writes are acknowledged after the fault heals.
"""

from __future__ import annotations

import os
import signal

import trio
from kera_client import open_admin, open_producer

from kera.errors import Unavailable

from .conftest import free_port
from .workload import consume_all, create, produce_all, send_and_flush, values


async def durable_chunks(coord) -> int:
    """Chunks durable on every broker (-1 while the coordinator cannot tell: down or starting)."""
    try:
        async with open_admin(coord) as a:
            return sum(v["durable"] for r in await a.broker_stats() for v in r["vlogs"])
    except Unavailable:
        return -1


async def wait_more_durable(coord, than: int, by: int = 200) -> int:
    """Until the brokers' durable chunks grew by ``by``: ingest is acknowledged again."""
    while (n := await durable_chunks(coord)) < than + by:
        await trio.sleep(0.05)
    return n


INGEST = 7  # the producer id written in the values of an Ingest
AFTER = 9   # ... and in those written once a fault healed


class Ingest:
    """One producer per stream set, sending until told to stop; counts what it sent."""

    def __init__(self, coord, streams, batch: int = 50):
        self.coord, self.streams, self.batch = coord, streams, batch
        self.sent = 0
        self.stop = trio.Event()

    async def run(self) -> None:
        # a small buffer: sends wait for acks instead of queueing minutes of records to check
        async with open_producer(self.coord, **{"linger.ms": 2, "buffer.memory": 1 << 20}) as prod:
            await prod.load_metadata(self.streams)
            while not self.stop.is_set():
                for s in self.streams:
                    await prod.send_many(s, values(INGEST, self.sent, self.batch))
                self.sent += self.batch
            await prod.flush()
            assert prod.acked == self.sent * len(self.streams), (prod.acked, self.sent)


async def test_two_backup_pauses_longer_than_the_replicate_timeout(make_cluster):
    """SIGSTOP one backup past the replicate timeout, SIGCONT, then another: nothing wedges."""
    cluster = make_cluster(3, broker_args=["--replicate-timeout", "1.0"])
    coord = cluster.coordinator
    streams = [f"p{i:02d}" for i in range(8)]
    await create(coord, streams, replication=3)
    ing = Ingest(coord, streams)
    with trio.fail_after(150):
        async with trio.open_nursery() as n:
            n.start_soon(ing.run)
            seen = await wait_more_durable(coord, 0)
            for name in ("node2-backup", "node3-backup"):
                pid = cluster.procs[name].pid
                os.kill(pid, signal.SIGSTOP)
                try:
                    await trio.sleep(3.0)  # the fault: a pause three times the replicate timeout
                    seen = await wait_more_durable(coord, seen)  # acks flow during the pause
                finally:
                    os.kill(pid, signal.SIGCONT)
                seen = await wait_more_durable(coord, seen)
            ing.stop.set()
        # after both pauses: more records to the same streams are acknowledged
        await send_and_flush(coord, streams, AFTER, 1000)
        ledger = await consume_all(coord, streams, (ing.sent + 1000) * len(streams))
    ledger.check({**{(s, INGEST): ing.sent for s in streams}, **{(s, AFTER): 1000 for s in streams}})
    async with open_admin(coord) as a:
        give_ups = sum(v["give_ups"] for r in await a.broker_stats() for v in r["vlogs"])
    assert give_ups >= 1, "the pauses outlasted the replicate timeout: copies were given up and moved"


async def test_single_node_cluster_keeps_everything_across_kill_9(make_cluster):
    """R=1 on one node still writes a disk copy: kill -9 everything, start again, all is back."""
    cluster = make_cluster(1)
    coord = cluster.coordinator
    streams = [f"s{i}" for i in range(4)]
    await create(coord, streams, replication=1, streamlets=2)
    with trio.fail_after(120):
        await produce_all(coord, streams, 2, 2500, 5)   # 20,000 acknowledged records
        cluster.kill_all()
        cluster.start()  # same data dir and coordinator port
        coord = cluster.coordinator
        await send_and_flush(coord, streams, AFTER, 100)  # new writes after the fault
        ledger = await consume_all(coord, streams, 20_000 + 100 * len(streams))
    ledger.check({**{(s, p): 2500 for s in streams for p in range(2)}, **{(s, AFTER): 100 for s in streams}})


async def test_coordinator_killed_and_restarted_during_ingest_is_not_a_cluster_reset(make_cluster):
    """Brokers keep their data and rejoin as the same incarnations: nothing is recovered."""
    cluster = make_cluster(3, port=free_port())
    coord = cluster.coordinator
    streams = [f"c{i:02d}" for i in range(8)]
    await create(coord, streams, replication=3)
    async with open_admin(coord) as a:
        before = {b["id"]: b["epoch"] for b in (await a.status())["brokers"]}
    ing = Ingest(coord, streams, batch=20)
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            n.start_soon(ing.run)
            seen = await wait_more_durable(coord, 0)
            cluster.kill("coordinator")
            down = trio.current_time()
            await trio.sleep(2.0)  # the fault: the coordinator is down for two seconds
            cluster.restart("coordinator")
            back = trio.current_time()
            seen = await wait_more_durable(coord, seen)
            resumed = trio.current_time()
            ing.stop.set()
        await send_and_flush(coord, streams, AFTER, 500)
        ledger = await consume_all(coord, streams, (ing.sent + 500) * len(streams))
    ledger.check({**{(s, INGEST): ing.sent for s in streams}, **{(s, AFTER): 500 for s in streams}})
    async with open_admin(coord) as a:
        st = await a.status()
    assert {b["id"]: b["epoch"] for b in st["brokers"] if b["alive"]} == before
    assert st["recoveries"] == [], "a coordinator restart recovered live brokers"
    print(f"coordinator down {back - down:.2f} s; acks resumed {resumed - back:.2f} s after its restart")
    assert "rejoined a restarted coordinator" in cluster.log("node1-broker")
