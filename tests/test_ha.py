"""Highly available metadata: coordinators on a real etcd, killed for real.

Each cluster test runs three coordinators on a local etcd; the leader (or
etcd itself) is killed with SIGKILL during ingest, and every acknowledged
record must be read back exactly once with no broker recovered (their state
is never dropped because the coordinator changed).
"""

from __future__ import annotations

import time

import pytest
import trio
from kera_client import open_admin, open_consumer, open_producer

from kera.coordinator import etcd
from kera.coordinator.etcd_store import Election, EtcdMeta
from kera.coordinator.link import CoordinatorLink, split_addrs
from kera.errors import InvalidArgument, NotLeader, Unavailable
from kera.rpc import open_pool

from .workload import Ledger, TimedIngest, create, read_values, send_and_flush, status, values

pytestmark = pytest.mark.timeout(180)

STREAMS = [f"ha{i}" for i in range(4)]


async def consume_until(coord, streams, ledger: Ledger, ingest: TimedIngest, done: trio.Event):
    """Read concurrently with the ingest; after it stopped, until everything it sent is in."""
    async with open_consumer(streams, coord) as c:
        while not (done.is_set() and ledger.records >= ingest.sent * len(streams)):
            for ch in await c.poll_chunks(0.5):
                ledger.add(ch)


async def leader_name(cluster) -> str:
    st = await status(cluster.coordinator)
    by_addr = {cluster.addrs[n]: n for n in cluster.coordinator_names()}
    return by_addr[st["coordinators"]["leader"]]


async def run_through(cluster, fault) -> TimedIngest:
    """Ingest and consume while ``fault(ingest)`` runs; checks exactly-once and no recovery."""
    coord = cluster.coordinator
    await create(coord, STREAMS, streamlets=2, replication=3)
    before = {b["id"]: b["epoch"] for b in (await status(coord))["brokers"]}
    ingest, ledger, done = TimedIngest(coord, STREAMS), Ledger(), trio.Event()
    with trio.fail_after(150):
        async with trio.open_nursery() as n:
            n.start_soon(consume_until, coord, STREAMS, ledger, ingest, done)
            async with trio.open_nursery() as producing:
                producing.start_soon(ingest.run)
                await ingest.more()
                await fault(ingest)
                await ingest.more()
                ingest.stop.set()
            done.set()   # the ingest is over: ``sent`` is final
    ledger.check({(s, 1): ingest.sent for s in STREAMS})
    st = await status(coord)
    assert st["recoveries"] == [], "a coordinator change must not recover any broker"
    assert {b["id"]: b["epoch"] for b in st["brokers"] if b["alive"]} == before
    return ingest


async def test_leader_killed_during_ingest(make_cluster):
    """kill -9 of the leading coordinator: a standby takes over, ingest and reads go on."""
    cluster = make_cluster(3, coordinators=3)
    first = await leader_name(cluster)

    async def fault(ingest):
        cluster.kill(first)
        await ingest.more(20)
        assert await leader_name(cluster) != first

    ingest = await run_through(cluster, fault)
    print(f"longest produce stall across the leader change: {ingest.longest:.2f} s, "
          f"{ingest.sent * len(STREAMS)} records")
    async with open_admin(cluster.coordinator) as a:   # metadata changes work on the new leader
        await a.create_stream("after", streamlets=1, replication=3)
        assert {s.name for s in await a.list_streams()} >= {*STREAMS, "after"}


async def test_etcd_killed_and_restarted(make_cluster):
    """kill -9 of etcd: produce and pull go on for at least a lease, metadata changes wait,
    and once etcd is back on its data dir everything resumes without loss."""
    cluster = make_cluster(3, coordinators=3)

    async def fault(ingest):
        cluster.kill("etcd")
        killed = time.monotonic()
        await ingest.more(3)   # existing streams keep taking writes on the brokers' leases
        assert time.monotonic() - killed < 1.5, "writes were refused right after etcd died"
        with pytest.raises(Unavailable):
            async with open_admin(cluster.coordinator) as a:
                a.timeout = 2.0
                await a.create_stream("during", streamlets=1, replication=3)
        cluster.restart("etcd")
        await ingest.more(10)

    ingest = await run_through(cluster, fault)
    print(f"longest produce stall across the etcd restart: {ingest.longest:.2f} s")
    async with open_admin(cluster.coordinator) as a:
        await a.create_stream("after", streamlets=1, replication=3)


async def test_metadata_survives_leader_changes(make_cluster):
    """Streams and committed positions written through one leader are there for the next."""
    cluster = make_cluster(3, coordinators=3)
    coord = cluster.coordinator
    await create(coord, ["kept"], streamlets=2, replication=3)
    await send_and_flush(coord, ["kept"], 2, 100)
    with trio.fail_after(120):
        async with open_consumer(["kept"], coord, group="g") as c:
            assert len(await read_values(c, 100)) == 100
            await c.commit()
        for _ in range(2):
            cluster.kill(await leader_name(cluster))
        async with open_admin(coord) as a:
            assert [s.name for s in await a.list_streams()] == ["kept"]
        async with open_producer(coord) as p:
            await p.send_many("kept", values(2, 100, 50))
            await p.flush()
        async with open_consumer(["kept"], coord, group="g") as c:   # continues where g stopped
            got = await read_values(c, 50)
    counters = sorted(int.from_bytes(bytes(v[4:12]), "little") for v in got)
    assert counters == list(range(100, 150))


# -- the election and the store, against a real etcd --------------------------------------
@pytest.fixture
def local_etcd(tmp_path):
    e = etcd.LocalEtcd(str(tmp_path / "etcd"))
    e.start()
    yield e
    e.stop()


async def test_a_deposed_leader_cannot_write(local_etcd):
    """Fencing at the store: once another coordinator won, the old one's writes are refused."""
    a_cli, b_cli = etcd.Etcd([local_etcd.endpoint]), etcd.Etcd([local_etcd.endpoint])
    a, b = Election(a_cli, "/t/", "a:1"), Election(b_cli, "/t/", "b:1")
    initial = {"n": 0, "streams": {}}
    with trio.fail_after(30):
        await a.campaign()
        store_a = EtcdMeta(a_cli, "/t/", a, initial)
        await store_a.load()
        async with trio.open_nursery() as n:
            await n.start(store_a.run)
            store_a.set(("streams", "s1"), {"id": 1})
            store_a.set(("n",), 1)
            await store_a.commit()
            n.cancel_scope.cancel()
        with trio.move_on_after(0.5):
            await b.campaign()
        assert not b.leading() and b.leader == "a:1"
        await a_cli.revoke(a.lease)   # a's lease lapses (a paused past it, say)
        await b.campaign()
        store_b = EtcdMeta(b_cli, "/t/", b, initial)
        assert await store_b.load() == {"n": 1, "streams": {"s1": {"id": 1}}}
        store_a.set(("streams", "s2"), {"id": 2})   # a still believes it leads
        with pytest.raises(NotLeader):
            await store_a._write(store_a._ops([("streams", "s2")])[0])
        assert "s2" not in (await EtcdMeta(b_cli, "/t/", b, initial).load())["streams"]
    for c in (a_cli, b_cli):
        await c.aclose()


async def test_large_batches_split_within_etcd_limits(local_etcd):
    """Thousands of entries in one commit go out as several guarded transactions."""
    cli = etcd.Etcd([local_etcd.endpoint])
    el = Election(cli, "/big/", "a:1")
    with trio.fail_after(60):
        await el.campaign()
        store = EtcdMeta(cli, "/big/", el, {"next": 0, "streams": {}})
        await store.load()
        async with trio.open_nursery() as n:
            await n.start(store.run)
            for i in range(3000):
                store.set(("streams", f"s{i:05d}"), {"id": i, "pad": "x" * 400})
            store.set(("next",), 3000)
            await store.commit()
            store.delete(("streams", "s00007"))
            await store.commit()
            n.cancel_scope.cancel()
        again = await EtcdMeta(cli, "/big/", el, {"next": 0, "streams": {}}).load()
    assert again["next"] == 3000 and len(again["streams"]) == 2999 and "s00007" not in again["streams"]
    await cli.aclose()


def test_bad_coordinator_lists_are_refused():
    for bad in ("", " , ", "host", "a:1,b", "etcd://x"):
        with pytest.raises(InvalidArgument):
            split_addrs(bad)
    assert split_addrs("a:1, b:2,") == ["a:1", "b:2"]
    for bad in ("http://x:1", "etcd://", "etcd://host"):
        with pytest.raises(InvalidArgument):
            etcd.parse_url(bad)
    assert etcd.parse_url("etcd://h:1,g:2/team") == (["h:1", "g:2"], "/team/")


async def test_link_skips_dead_addresses_and_follows_the_leader(make_cluster, tmp_path):
    """A list with a dead address first still reaches the leader; a standby names it."""
    cluster = make_cluster(1, coordinators=2)
    leader = (await status(cluster.coordinator))["coordinators"]["leader"]
    standby = next(a for a in cluster.coordinator.split(",") if a != leader)
    async with open_pool() as pool:
        with pytest.raises(NotLeader) as e:
            await pool.call(standby, "status", {}, timeout=5)
        assert e.value.leader == leader
        link = CoordinatorLink(pool, f"127.0.0.1:1,{standby}")
        r, _ = await link.call("status", {}, timeout=10)
        assert r["coordinators"]["leader"] == leader and link.leader == leader
        one = CoordinatorLink(pool, standby)   # one address given: its hint is followed
        r, _ = await one.call("status", {}, timeout=10)
        assert r["coordinators"]["leader"] == leader
