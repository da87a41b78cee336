"""Consumer-group positions in the internal stream ``__consumer_positions``: durable
through a broker kill and a whole-cluster restart, reserved, and cheap for the
coordinator when many consumers commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import trio
from kera_client import open_admin, open_consumer
from kera_client.positions import GroupPositions

from kera import group_positions as gp
from kera.coordinator.metadata import INITIAL
from kera.coordinator.metalog import MetaLog
from kera.coordinator.service import Coordinator
from kera.errors import InvalidArgument, InvalidName
from kera.rpc import open_pool

from .members import SECRET
from .test_scale import serving
from .workload import create, read_values, send_and_flush


def _pairs(values) -> list[tuple[int, int]]:
    """(producer, counter) of each value (``workload.values``' layout), sorted."""
    return sorted((int.from_bytes(v[0:4], "little"), int.from_bytes(v[4:12], "little")) for v in values)


def test_records_round_trip_per_stream_and_forget_recreated_streams():
    pos = {"a/0": {"low": 0, "groups": {"0": 5}},
           "a/1": {"low": 1, "groups": {"1": 7}, "skip": {"1": [7, 3]}},
           "b/0": {"low": 2, "groups": {}}}
    keys, values = gp.encode("G", pos, {"a": 1, "b": 2})
    assert len(keys) == 2   # one record per stream
    latest = dict(zip(keys, values, strict=True))
    other, ov = gp.encode("H", {"a/0": {"low": 0, "groups": {"0": 9}}}, {"a": 1})
    latest.update(zip(other, ov, strict=True))   # another group in the same streamlet
    assert gp.decode("G", latest) == pos
    assert gp.decode("G", latest, {"a": 1, "b": 3}) == {k: v for k, v in pos.items() if k[0] == "a"}
    assert gp.decode("G", latest, {"b": 2}) == {"b/0": pos["b/0"]}
    assert gp.decode("nobody", latest) == {}
    assert 0 <= gp.streamlet_of("G", 8) < 8
    for bad in ("", "x" * 250, 7, None):
        with pytest.raises(InvalidArgument):
            gp.check_group(bad)


async def test_positions_survive_a_broker_kill_and_a_whole_cluster_restart(make_cluster):
    cluster = make_cluster(3)
    coord = cluster.coordinator
    with trio.fail_after(120):
        await create(coord, ["p"], streamlets=2, replication=3)
        await send_and_flush(coord, ["p"], producer=0, n=100)
        async with open_consumer(["p"], coord, group="G") as c:
            assert _pairs(await read_values(c, 100)) == [(0, k) for k in range(100)]
            await c.commit()
            assert await c.committed() == c.position()
        async with open_admin(coord) as a:
            ps = await a.describe_stream(gp.NAME)
        assert ps.replication == 3 and ps.cleanup_policy == "compact"
        owner = ps.addrs[gp.streamlet_of("G", ps.streamlets)]
        cluster.kill(next(n for n, a in cluster.addrs.items() if a == owner))   # the group's streamlet

        await send_and_flush(coord, ["p"], producer=1, n=50)
        async with open_consumer(["p"], coord, group="G") as c:   # its streamlet recovered elsewhere
            assert _pairs(await read_values(c, 50)) == [(1, k) for k in range(50)]
            await c.commit()
            committed = await c.committed()

    cluster.kill_all()   # every process, kill -9; restarted on the same data dirs
    cluster.start()
    coord = cluster.coordinator
    with trio.fail_after(90):
        await serving(coord)
        await send_and_flush(coord, ["p"], producer=2, n=30)
        async with open_consumer(["p"], coord, group="G") as c:
            assert await c.committed() == committed
            assert _pairs(await read_values(c, 30)) == [(2, k) for k in range(30)]


async def test_the_positions_stream_is_reserved_and_bad_input_is_refused(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    with trio.fail_after(60):
        await create(coord, ["s"], replication=1)
        async with open_consumer(["s"], coord) as c:
            with pytest.raises(ValueError):   # no group to commit for
                await c.commit()
        async with open_consumer(["s"], coord, group="G") as c:
            await c.commit()   # creates the internal stream
            for bad in ("", "x" * 250, 7):
                with pytest.raises(InvalidArgument):
                    await c._positions().commit(bad, c.position(), {"s": c.streams["s"].id})
        async with open_admin(coord) as a:
            assert [s.name for s in await a.list_streams()] == ["s"]   # not listed, not a pattern's
            assert [s["name"] for s in (await a.call("metadata", pattern="*"))["streams"]] == ["s"]
            for call in (lambda: a.delete_stream(gp.NAME), lambda: a.alter_stream(gp.NAME, 10, None),
                         lambda: a.create_stream(gp.NAME)):
                with pytest.raises(InvalidName):
                    await call()
            assert (await a.describe_stream(gp.NAME)).streamlets == gp.SHAPE["streamlets"]
            for policy in ("compact", "delete", "compact,delete"):
                s = await a.create_stream(f"c-{policy.replace(',', '-')}", replication=1,
                                          **{"cleanup.policy": policy})
                assert s.cleanup_policy == policy
            with pytest.raises(InvalidArgument):
                await a.create_stream("c-bad", replication=1, cleanup_policy="shrink")
            assert "c-bad" not in {s.name for s in await a.list_streams()}
        async with open_consumer(["s"], coord, group="G") as c:   # the coordinator served on
            assert await c.committed() == c.position()


def _percentiles(xs) -> str:
    a = np.array(xs) * 1000
    return f"p50 {np.percentile(a, 50):.2f} ms, p99 {np.percentile(a, 99):.2f} ms ({len(a)} samples)"


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _metadata_latency(coord: str, seconds: float, pid: int) -> tuple[list[float], float]:
    """A cheap coordinator request (where one stream lives), every 10 ms for ``seconds``;
    and the coordinator's CPU use meanwhile (CPU seconds per second)."""
    out = []
    cpu, t = _cpu(pid), time.monotonic()
    async with open_pool() as pool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            await pool.call(coord, "metadata", {"names": ["t"]}, timeout=10)
            out.append(time.monotonic() - t0)
            await trio.sleep(0.01)
    return out, (_cpu(pid) - cpu) / (time.monotonic() - t)


@pytest.mark.timeout(240)
async def test_a_thousand_committing_consumers_leave_the_coordinator_alone(make_cluster, tmp_path):
    """1,000 consumers (4 processes of 250) commit every 100 ms through the real path. The
    coordinator's metadata latency before and during is printed (measured, not asserted),
    beside the same request to the coordinator of an idle one-node cluster in the same
    windows: what both show is the machine's load, not the coordinator's. Every group's last
    acknowledged commit is what a fetch reads back."""
    cluster, idle = make_cluster(3), make_cluster(1)
    coord = cluster.coordinator
    procs_n, per, seconds = 4, 250, 5.0
    await create(coord, ["t"], streamlets=1, replication=3)
    await create(idle.coordinator, ["t"], streamlets=1, replication=1)
    pid = cluster.procs["coordinator"].pid

    async def measure() -> dict:
        out = {}

        async def one(name, addr, p):
            out[name] = await _metadata_latency(addr, 2.5, p)
        async with trio.open_nursery() as n:
            n.start_soon(one, "kera", coord, pid)
            n.start_soon(one, "idle", idle.coordinator, idle.procs["coordinator"].pid)
        return out

    before = await measure()
    procs, outs = [], []
    for i in range(procs_n):
        outs.append(str(tmp_path / f"w{i}.json"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.positions_worker", coord, "t", str(i * per), str(per),
             str(seconds), outs[-1]], stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__))))
    try:
        for p in procs:   # every consumer committed once: all of them are at work
            line = await trio.to_thread.run_sync(p.stdout.readline)
            assert line.strip() == b"ready", line
        window = time.monotonic()
        during = await measure()
        window = (window, time.monotonic())
        for p in procs:
            assert await trio.to_thread.run_sync(p.wait, 120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    last, latencies, done_at = {}, [], []
    for path in outs:
        with open(path) as f:
            r = json.load(f)
        last.update(r["last"])
        latencies += r["latencies"]
        done_at += r["done_at"]
    assert len(last) == procs_n * per
    with trio.fail_after(60):
        async with open_pool() as pool:
            store = GroupPositions(pool, coord)
            for group, n in last.items():
                got = await store.fetch(group)
                assert got["t/0"]["groups"] == {"0": n}, group
    rate = sum(window[0] <= t <= window[1] for t in done_at) / (window[1] - window[0])
    for when, m in (("before", before), ("during", during)):
        print(f"\ncoordinator metadata {when}: {_percentiles(m['kera'][0])}, CPU {m['kera'][1]:.1%}; "
              f"idle cluster's coordinator: {_percentiles(m['idle'][0])}")
    print(f"commits: {rate:.0f}/s while measured; latency {_percentiles(latencies)}")


async def test_positions_of_an_older_metadata_are_dropped_once(tmp_path):
    """Positions an earlier version committed to the coordinator's metadata: groups start
    afresh, and the metadata no longer carries them."""
    d = str(tmp_path)

    async def persisted(store, change=None):
        async with trio.open_nursery() as n:
            await n.start(store.run)
            if change:
                store.set(*change)
            await store.commit()
            n.cancel_scope.cancel()
        store.close()

    await persisted(MetaLog(d, INITIAL), (("positions",), {"g": {"s/0": {"low": 0, "groups": {"0": 7}}}}))
    m = MetaLog(d, INITIAL)
    assert m.state["positions"]
    m.close()
    c = Coordinator(d, cluster_secret=SECRET)
    assert "positions" not in c.metadata.state
    await persisted(c.metadata.store)
    m = MetaLog(d, INITIAL)
    assert "positions" not in m.state
    m.close()


def test_records_that_are_not_commits_are_skipped_by_a_fetch():
    """The positions stream may hold records something else wrote: a fetch skips them."""
    good = {gp.msgpack.packb(["g", "s"]): gp.msgpack.packb([3, [[0, 1, {0: 5}, {}]]])}
    junk = {b"junk": b"x", gp.msgpack.packb(["g", "t"]): b"\xc1",
            gp.msgpack.packb(["g", "u"]): gp.msgpack.packb([1, [[0]]])}
    assert gp.decode("g", {**junk, **good}) == {"s/0": {"low": 1, "groups": {"0": 5}}}
