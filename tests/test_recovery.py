"""Crash recovery: dead brokers' streamlets come back from the backups."""

from __future__ import annotations

import os
import signal

import trio
from kera_client import open_admin, open_consumer, open_producer

from kera.rpc import open_pool

from .workload import Ledger, consume_all, create, produce_all, values


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


async def cluster_status(coord) -> dict:
    async with open_admin(coord) as a:
        return await a.status()


async def until(coord, pred, what: str) -> dict:
    """Poll the coordinator's status until ``pred`` holds (the caller bounds the time)."""
    while not pred(st := await cluster_status(coord)):
        await trio.sleep(0.1)
    return st


async def test_recovery_after_a_mass_failure_waits_for_the_backups(make_cluster):
    """Every backup declared dead, then a broker re-registers (a new incarnation) before any
    of them: the recovery of its old incarnation must not call a log with no copy in sight
    complete. It waits, and once the backups are back every acknowledged record is there.
    (The order a healed partition of the coordinator once gave: the streamlets were handed
    over empty.)"""
    cluster = make_cluster(3)
    coord = cluster.coordinator
    streams = [f"m{i:02d}" for i in range(24)]
    await create(coord, streams, replication=3)
    producers, per_pair = 2, 60
    with trio.fail_after(150):
        await produce_all(coord, streams, producers, per_pair, 3)
        old = {b["id"]: b["epoch"] for b in (await cluster_status(coord))["brokers"]}
        victim = next(b["id"] for b in (await cluster_status(coord))["brokers"]
                      if b["addr"] == cluster.addrs["node1-broker"])
        backups = [f"node{i}-backup" for i in (1, 2, 3)]
        for name in backups:
            cluster.kill(name, signal.SIGSTOP)
        await until(coord, lambda st: not any(b["alive"] for b in st["backups"]), "backups dead")
        cluster.kill("node1-broker")
        cluster.restart("node1-broker")   # a new incarnation, registered before any backup
        st = await until(coord, lambda st: any(
            r["broker"] == victim and r["epoch"] == old[victim] and r["state"] in ("waiting", "done")
            for r in st["recoveries"]), "the old incarnation's recovery")
        rec = next(r for r in st["recoveries"] if r["broker"] == victim)
        for name in backups:
            cluster.kill(name, signal.SIGCONT)
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})
    assert rec["state"] == "waiting" and "may hold its copies" in rec["error"], rec
    done = [r for r in (await cluster_status(coord))["recoveries"]
            if r["broker"] == victim and r["state"] == "done"]
    assert done and done[-1]["vlogs"] > 0 and not done[-1]["unproven"], done


async def test_a_coordinator_hearing_nobody_suspects_itself(make_cluster):
    """Every server silent at once for three times the failure timeout (all stopped, as a
    coordinator cut off from everyone sees it): nobody is declared dead, nothing is
    recovered, every incarnation carries on, and writes go on once they are heard again."""
    cluster = make_cluster(3)
    coord = cluster.coordinator
    streams = [f"q{i:02d}" for i in range(12)]
    await create(coord, streams, replication=3)
    with trio.fail_after(120):
        await produce_all(coord, streams, 1, 30, 1)
        before = await cluster_status(coord)
        servers = [f"node{i}-{r}" for i in (1, 2, 3) for r in ("backup", "broker")]
        for name in servers:
            cluster.kill(name, signal.SIGSTOP)
        await trio.sleep(6.0)   # the failure timeout is 2 s: three of them without a word
        for name in servers:
            cluster.kill(name, signal.SIGCONT)
        async with open_producer(coord) as prod:   # a second producer, once they are heard
            for s in streams:
                await prod.send_many(s, values(1, 0, 30))
            await prod.flush()
        after = await cluster_status(coord)
        ledger = await consume_all(coord, streams, 60 * len(streams))

    def incarnations(st):
        return sorted((role, m["id"], m["epoch"], m["alive"]) for role in ("brokers", "backups")
                      for m in st[role])
    assert incarnations(after) == incarnations(before), (before, after)
    assert after["recoveries"] == [], after["recoveries"]
    assert "went silent at once" in cluster.log("coordinator")
    ledger.check({(s, p): 30 for s in streams for p in range(2)})


async def test_a_stream_altered_during_its_recovery_reaches_its_new_owner(make_cluster, monkeypatch, tmp_path):
    """A recovery's hand-over names by id the streams it assigned, resending only the maps of
    those altered since: streams altered between the assign and the hand-over (failpoint
    ``recovery.handover``) are served by their new owners with the altered settings, the
    others with theirs."""
    gate = str(tmp_path / "handover")
    monkeypatch.setenv("KERA_FAILPOINTS", f"recovery.handover=pause({gate})")
    cluster = make_cluster(3)
    monkeypatch.delenv("KERA_FAILPOINTS")
    coord = cluster.coordinator
    names = [f"alt{i}" for i in range(12)]
    await create(coord, names, replication=3)
    with trio.fail_after(120):
        await produce_all(coord, names, 1, 5, 1)
        async with open_admin(coord) as a:
            views = [await a.describe_stream(n) for n in names]
        victim = cluster.addrs["node1-broker"]
        moved = {v.id: v.name for v in views if victim in v.addrs}
        assert len(moved) >= 2, views
        altered = dict(list(moved.items())[::2])
        cluster.kill("node1-broker")
        while not os.path.exists(gate):   # replayed, not handed over
            await trio.sleep(0.05)
        async with open_admin(coord) as a:
            for name in altered.values():
                await a.alter_stream(name, retention_bytes=123_456)
        os.remove(gate)
        await until(coord, lambda st: any(r["state"] == "done" for r in st["recoveries"]),
                    "the recovery done")
        async with open_admin(coord) as a:
            held = {sid: e for r in await a.broker_stats(streams=True) for sid, e in r["streams"].items()}
    assert {sid: held[sid]["retention_bytes"] for sid in moved} == {
        sid: 123_456 if sid in altered else -1 for sid in moved}, held
