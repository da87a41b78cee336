"""Crash recovery: dead brokers' streamlets come back from the backups."""

from __future__ import annotations

import trio
from kera_client import open_admin, open_consumer

from kera.rpc import open_pool

from .workload import Ledger, consume_all, create, produce_all


async def chunks_appended(coord) -> int:
    async with open_admin(coord) as a:
        return sum(r["chunks"] for r in await a.broker_stats())


async def wait_chunks(coord, n: int) -> None:
    while await chunks_appended(coord) < n:
        await trio.sleep(0.05)


async def wait_durable_on(addr: str, n: int) -> None:
    """Until the broker at ``addr`` has n chunks on all their copies."""
    async with open_pool() as pool:
        while True:
            r, _ = await pool.call(addr, "stats", {}, timeout=5)
            if sum(v["durable"] for v in r["vlogs"]) >= n:
                return
            await trio.sleep(0.05)


async def recoveries(coord) -> list[dict]:
    async with open_admin(coord) as a:
        return (await a.status())["recoveries"]


STREAMS = [f"r{i:03d}" for i in range(256)]


async def test_broker_killed_mid_ingest_loses_nothing(make_cluster):
    cluster = make_cluster(4)
    coord = cluster.coordinator
    await create(coord, STREAMS, replication=3)
    producers, per_pair = 4, 240
    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            n.start_soon(produce_all, coord, STREAMS, producers, per_pair, 24)
            await wait_durable_on(cluster.addrs["node2-broker"], 1000)
            cluster.kill("node2-broker")
        # producers finished on their own: every record acknowledged
        ledger = await consume_all(coord, STREAMS, producers * per_pair * len(STREAMS))
    ledger.check({(s, p): per_pair for s in STREAMS for p in range(producers)})
    done = [r for r in await recoveries(coord) if r["state"] == "done"]
    assert done and done[-1]["chunks"] > 0
    print("recovery:", done[-1])


async def test_restarted_broker_is_fenced_and_serves_nothing_stale(make_cluster):
    cluster = make_cluster(4)
    coord = cluster.coordinator
    streams = STREAMS[:64]
    await create(coord, streams, replication=3)
    async with open_admin(coord) as a:
        before = {s: await a.describe_stream(s) for s in streams}
    victim_addr = cluster.addrs["node3-broker"]
    lost = [(d.id, i) for d in before.values() for i, addr in enumerate(d.addrs) if addr == victim_addr]
    assert lost
    producers, per_pair = 3, 300
    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            n.start_soon(produce_all, coord, streams, producers, per_pair, 30)
            await wait_chunks(coord, 1000)
            cluster.kill("node3-broker")
            # back at once, same identity (same data dir), while its streamlets are recovered
            new_addr = cluster.restart("node3-broker")
        async with open_pool() as pool:
            r, _ = await pool.call(new_addr, "pull", {"streamlets": [[sid, i, 0, {}] for sid, i in lost]},
                                   timeout=5)
        # it serves only what was recovered onto it, after the hand-over
        async with open_admin(coord) as a:
            after = {d.id: d for d in [await a.describe_stream(s) for s in streams]}
        served = {(e[0], e[1]) for e in r["entries"]}
        for sid, i in served:
            assert after[sid].addrs[i] == new_addr, "served a streamlet it does not own"
        for _sid, _i, code in r["errors"]:
            assert code in ("not_owner", "recovering")
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})


async def test_broker_killed_while_a_backup_is_dead(make_cluster):
    cluster = make_cluster(4)
    coord = cluster.coordinator
    streams = STREAMS[:128]
    await create(coord, streams, replication=3)
    producers, per_pair = 3, 300
    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            n.start_soon(produce_all, coord, streams, producers, per_pair, 30)
            await wait_chunks(coord, 500)
            cluster.kill("node1-backup")
            await wait_chunks(coord, 2000)
            cluster.kill("node2-broker")
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})


async def test_whole_cluster_killed_and_restarted(make_cluster):
    cluster = make_cluster(3)
    coord = cluster.coordinator
    streams = [f"w{i:03d}" for i in range(200)]
    await create(coord, streams, replication=3, groups=2)
    producers, per_pair = 2, 100
    with trio.fail_after(240):
        await produce_all(coord, streams, producers, per_pair, 5)
        cluster.kill_all()
        cluster.start()  # same data dir: coordinator metadata, backups' segment files
        ledger = await consume_all(cluster.coordinator, streams, producers * per_pair * len(streams),
                                   idle=30)
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})


async def test_consumer_reading_through_a_crash(make_cluster):
    cluster = make_cluster(4)
    coord = cluster.coordinator
    streams = STREAMS[:64]
    await create(coord, streams, replication=3)
    producers, per_pair = 2, 600
    total = producers * per_pair * len(streams)
    ledger = Ledger()
    with trio.fail_after(240):
        async with open_consumer(streams, coord) as c:
            async with trio.open_nursery() as n:
                n.start_soon(produce_all, coord, streams, producers, per_pair, 60)
                while ledger.records < total // 4:
                    for ch in await c.poll_chunks(1.0):
                        ledger.add(ch)
                cluster.kill("node4-broker")
                while ledger.records < total:
                    for ch in await c.poll_chunks(1.0):
                        ledger.add(ch)
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})
