"""Partitions during ingest: each server in its own network namespace, links cut for real.

A cluster of one coordinator and three nodes (each node a broker host and a backup
host) runs every server in a namespace of its own, with a link per pair of hosts
(``tests/netns.py``); the test process is the client host. Each scenario creates
its own streams (R=3), ingests numbered records with one idempotent producer
(acks=all, a batch to every stream then a flush, so the longest flush is the
longest produce stall), cuts links, heals them, and checks: writes resume, every
broker and backup is alive and serves under a live lease, ``kera status`` is
healthy, and every acknowledged record is read back exactly once.

The scenarios share one cluster (each starts once the last one healed and
deletes its streams at the end): a fault that left the cluster unhealthy fails
the next scenario's start as well as its own end. The etcd one has its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest
import trio
from kera_client import open_admin

from kera.cluster import LocalCluster
from kera.errors import KeraError
from kera.rpc import open_pool

from .netns import CLIENT, Network
from .workload import Ledger, TimedIngest, create, read_to_end

pytestmark = pytest.mark.timeout(150)

DEAD_AFTER = 2.0   # the coordinator's; a broker's lease is 0.75 of it
CUT = 12.0         # the cut, for a node and the coordinator
LATE = 2           # the producer written in the values of a producer started during a fault


@contextmanager
def _cluster(tmp, **kw):
    """A cluster of 3 nodes, each server in a namespace of its own: (cluster, network), both
    removed at the end whatever happened."""
    if os.geteuid() != 0:
        raise RuntimeError("the partition tests make network namespaces: they must run as root")
    cluster = LocalCluster(str(tmp), 3, coordinator_args=["--dead-after", str(DEAD_AFTER)], **kw)
    net = Network(cluster.names())
    cluster.hosts = net
    try:
        cluster.start()
        yield cluster, net
    finally:
        cluster.stop()
        net.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with _cluster(tmp_path_factory.mktemp("partitions")) as m:
        yield m


@pytest.fixture
def etcd_mesh(tmp_path):
    with _cluster(tmp_path / "ha", coordinators=3) as m:
        yield m


async def status(coord) -> dict:
    async with open_admin(coord) as a:
        a.timeout = 5.0
        return await a.status()


def _broker_host(st: dict, broker: int) -> str:
    node = next(b["node"] for b in st["brokers"] if b["id"] == broker)
    return f"{node}-broker"


async def serves(addr: str) -> bool:
    """The broker at ``addr`` takes writes now: an empty produce passes its lease check."""
    async with open_pool() as pool:
        try:
            await pool.call(addr, "produce", {"acks": "all"}, b"", timeout=2.0)
            return True
        except KeraError:
            return False


async def healthy(coord, nodes: int = 3, cli: bool = False) -> dict:
    """Until every broker and backup is alive and each broker serves under its lease, with no
    recovery under way nor any that lost data; then (``cli``) ``kera status`` must say so too."""
    why = "no status yet"
    try:
        while True:
            try:
                st = await status(coord)
            except KeraError as e:
                st, why = None, f"status: {e}"
            if st is not None:
                alive = [m for m in st["brokers"] + st["backups"] if m["alive"]]
                busy = [r for r in st["recoveries"] if r["state"] not in ("done",) or r["lost"]]
                serving = [await serves(b["addr"]) for b in st["brokers"]]
                if len(alive) == 2 * nodes and not busy and not st["adoptions"] and all(serving):
                    break
                why = (f"{len(alive)} alive, recoveries {busy}, adoptions {st['adoptions']}, brokers "
                       f"serving {serving}")
            await trio.sleep(0.2)
    except trio.Cancelled:   # a deadline of the caller's: say what was missing
        print(f"not healthy: {why}")
        raise
    if not cli:
        return st
    out = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "kera", "status", "--json", "--coordinator", coord],
        capture_output=True, text=True, timeout=30))
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert all(m["alive"] for m in shown["brokers"] + shown["backups"]), shown
    assert not [r for r in shown["recoveries"] if r["state"] != "done" or r["lost"]], shown["recoveries"]
    return st


async def scenario(cluster, name: str, fault) -> dict:
    """``fault(ingest, st, more)`` during ingest into fresh streams (``st``: the status before;
    ``more``: a list for the ingests it starts itself); checks and reports what it cost."""
    coord = cluster.coordinator
    with trio.fail_after(40):
        st = await healthy(coord)
    streams = [f"{name}{i}" for i in range(4)]
    await create(coord, streams, streamlets=3, replication=3)
    ingest, more = TimedIngest(coord, streams), []
    with trio.fail_after(100):
        async with trio.open_nursery() as n:
            n.start_soon(ingest.run)
            await ingest.more()
            cost = await fault(ingest, st, more) or {}
            healed = time.monotonic()
            await ingest.more()
            cost["resumed"] = time.monotonic() - healed
            ingest.stop.set()
        after = await healthy(coord, cli=True)
        got = await read_to_end(coord, streams)
    epochs = {b["id"]: b["epoch"] for b in after["brokers"]}
    moved = {b["id"] for b in st["brokers"] if epochs[b["id"]] != b["epoch"]}
    expected_moved = cost.pop("recovered", set())
    ledger = Ledger()
    for ch in got:
        ledger.add(ch)
    expected = {(s, ingest.who): ingest.sent for s in streams}
    for i in more:
        expected.update({(s, i.who): i.sent for s in i.streams})
    acked = sum(expected.values())
    unique = sum(len(np.unique(np.concatenate(p))) for p in _per_stream(ledger).values())
    cost.update(acknowledged=acked, read=ledger.records, duplicates=ledger.records - unique,
                longest_stall=round(ingest.longest, 2), recovered=sorted(moved))
    print(f"\n{name}: " + ", ".join(f"{k} {round(v, 2) if isinstance(v, float) else v}"
                                   for k, v in cost.items()))
    ledger.check(expected)
    assert moved == expected_moved, f"brokers recovered: {sorted(moved)}, not {sorted(expected_moved)}"
    async with open_admin(coord) as a:
        for s in streams:
            await a.delete_stream(s)
    return cost


def _per_stream(ledger: Ledger) -> dict:
    out: dict = {}
    for (stream, _, p), parts in ledger.seen.items():
        out.setdefault((stream, p), []).extend(parts)
    return out


async def test_client_cut_from_one_broker(mesh):
    """The client cannot reach one broker for 4 s; everyone else can: its streamlets wait."""
    cluster, net = mesh

    async def fault(ingest, st, more):
        host = _broker_host(st, st["brokers"][1]["id"])
        net.cut(CLIENT, host)
        await trio.sleep(4.0)
        net.heal(CLIENT, host)
        return {"cut": 4.0}

    await scenario(cluster, "client", fault)


async def test_broker_cut_from_one_backup(mesh):
    """A broker cannot reach one backup for 6 s (past its 5 s replicate timeout): that copy
    is given up and made on another backup; acks wait at most the replicate timeout."""
    cluster, net = mesh

    async def fault(ingest, st, more):
        host = _broker_host(st, st["brokers"][1]["id"])
        other = next(b["node"] for b in st["backups"] if b["node"] != host.split("-")[0])
        net.cut(host, f"{other}-backup")
        await trio.sleep(6.0)
        net.heal(host, f"{other}-backup")
        async with open_admin(cluster.coordinator) as a:
            stats = {r["broker"]: r for r in await a.broker_stats()}
        give_ups = sum(v["give_ups"] for v in stats[st["brokers"][1]["id"]]["vlogs"])
        assert give_ups >= 1, "the cut outlasted the replicate timeout: copies were given up"
        return {"cut": 6.0, "give_ups": give_ups}

    await scenario(cluster, "backup", fault)


async def test_broker_cut_from_the_coordinator(mesh):
    """Split brain: a broker the coordinator cannot hear, that backups and producers still
    reach, stops acknowledging once its lease lapses; its streamlets are recovered elsewhere
    and nothing it acknowledged is lost or duplicated."""
    cluster, net = mesh

    async def fault(ingest, st, more):
        b = st["brokers"][1]
        host = _broker_host(st, b["id"])
        net.cut(host, "coordinator")
        t0 = time.monotonic()
        while await serves(b["addr"]):   # the client still reaches it: it refuses, lease gone
            await trio.sleep(0.05)
        refused = time.monotonic() - t0
        assert refused < DEAD_AFTER, f"broker served {refused:.2f} s without a lease"
        while True:   # declared dead, its streamlets recovered elsewhere, and ingest goes on
            now = await status(cluster.coordinator)
            if any(r["broker"] == b["id"] and r["epoch"] == b["epoch"] and r["state"] == "done"
                   for r in now["recoveries"]):
                break
            await trio.sleep(0.1)
        await ingest.more()
        cut = time.monotonic() - t0
        net.heal(host, "coordinator")
        return {"cut": cut, "refused_after": refused, "recovered": {b["id"]}}

    await scenario(cluster, "split", fault)


async def test_broker_node_isolated(mesh):
    """A node (broker and backup hosts) cut from everyone for 12 s: its streamlets are
    recovered elsewhere, a request in flight to it fails over, and it rejoins afterwards."""
    cluster, net = mesh

    async def fault(ingest, st, more):
        b = st["brokers"][1]["id"]
        node = _broker_host(st, b).split("-")[0]
        net.isolate(f"{node}-broker", f"{node}-backup")
        await trio.sleep(CUT)
        net.rejoin(f"{node}-broker", f"{node}-backup")
        return {"cut": CUT, "recovered": {b}}

    await scenario(cluster, "node", fault)


async def test_coordinator_isolated(mesh):
    """The coordinator cut from everyone for 12 s: brokers stop acknowledging when their
    leases lapse, nobody is recovered for it (the coordinator suspects itself, not all of
    them), and a producer started meanwhile waits for it."""
    cluster, net = mesh

    async def fault(ingest, st, more):
        net.isolate("coordinator")
        t0 = time.monotonic()
        async with trio.open_nursery() as n:
            late = TimedIngest(cluster.coordinator, ingest.streams[:1], who=LATE)
            more.append(late)
            n.start_soon(late.run)
            await trio.sleep(CUT)
            net.rejoin("coordinator")
            await late.more(1)
            late.stop.set()
        return {"cut": time.monotonic() - t0}

    await scenario(cluster, "coord", fault)


async def test_leading_coordinator_isolated(etcd_mesh):
    """Three coordinators on etcd: the leader's host cut from everyone for 12 s; a standby
    leads, brokers follow it, nobody is recovered."""
    cluster, net = etcd_mesh

    async def fault(ingest, st, more):
        by_addr = {cluster.addrs[n]: n for n in cluster.coordinator_names()}
        leader = by_addr[st["coordinators"]["leader"]]
        net.isolate(leader)
        await trio.sleep(CUT)
        net.rejoin(leader)
        return {"cut": CUT, "leader": leader}

    await scenario(cluster, "ha", fault)
