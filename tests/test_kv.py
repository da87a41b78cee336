"""The linearizable key-value map on a stream, and the checker that judges its histories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import trio
from kera_client import open_admin
from kera_client.kv import open_kv

from kera import chunk
from kera.errors import KeraError

from .linearizability import Op, check
from .workload import producer_id, read_to_end, status

INF = None


def ops(*rows):
    """(process, kind, key, arg, start, done, result) rows as Ops."""
    return [Op(*r) for r in rows]


# -- the checker on known histories ---------------------------------------------------------
def test_checker_accepts_sequential_and_overlapping_histories():
    assert check(ops((0, "put", "k", "a", 0, 1, 1), (1, "get", "k", None, 2, 3, "a"),
                     (0, "cas", "k", (1, "b"), 4, 5, True), (1, "cas", "k", (1, "c"), 6, 7, False),
                     (0, "delete", "k", None, 8, 9, True), (1, "get", "k", None, 10, 11, None))) == []
    # a read overlapping a write may see either value
    for seen in ("a", "b"):
        assert check(ops((0, "put", "k", "a", 0, 1, 1), (0, "put", "k", "b", 2, 6, 2),
                         (1, "get", "k", None, 3, 4, seen))) == []


def test_checker_flags_stale_reads_lost_writes_and_invented_values():
    stale = ops((0, "put", "k", "a", 0, 1, 1), (0, "put", "k", "b", 2, 3, 2),
                (1, "get", "k", None, 4, 5, "a"))
    assert check(stale) == ["k"]
    twice = ops((0, "put", "k", "a", 0, 1, 1), (0, "cas", "k", (1, "b"), 2, 3, True),
                (1, "cas", "k", (1, "c"), 4, 5, True))
    assert check(twice) == ["k"]
    invented = ops((0, "put", "k", "a", 0, 1, 1), (1, "get", "k", None, 2, 3, "zzz"))
    assert check(invented) == ["k"]
    resurrected = ops((0, "put", "k", "a", 0, 1, 1), (0, "delete", "k", None, 2, 3, True),
                      (1, "get", "k", None, 4, 5, "a"))
    assert check(resurrected) == ["k"]
    # a read that goes back in time after another read saw the new value
    back = ops((0, "put", "k", "a", 0, 1, 1), (0, "put", "k", "b", 2, 10, 2),
               (1, "get", "k", None, 3, 4, "b"), (2, "get", "k", None, 5, 6, "a"))
    assert check(back) == ["k"]
    independent = ops((0, "put", "x", "a", 0, 1, 1), (0, "put", "k", "b", 2, 3, 1),
                      (1, "get", "x", None, 4, 5, "a"), (1, "get", "k", None, 6, 7, "b"))
    assert check(independent) == []


def test_checker_lets_unanswered_operations_happen_or_not():
    landed = ops((0, "put", "k", "a", 0, INF, None), (1, "get", "k", None, 5, 6, "a"))
    lost = ops((0, "put", "k", "a", 0, INF, None), (1, "get", "k", None, 5, 6, None))
    assert check(landed) == [] and check(lost) == []
    # but not before it was invoked
    early = ops((1, "get", "k", None, 0, 1, "a"), (0, "put", "k", "a", 2, INF, None))
    assert check(early) == ["k"]


# -- the map against a real cluster -----------------------------------------------------------
async def test_map_operations_versions_and_a_second_client(make_cluster):
    cluster = make_cluster(3)
    coord = cluster.coordinator
    with trio.fail_after(60):
        async with open_kv("m", coord) as a, open_kv("m", coord) as b:
            assert await a.put("color", "blue") == 1
            assert await b.get("color") == b"blue"            # another client, at once
            assert await b.put("color", "red") == 2
            assert await a.compare_and_set("color", 1, "x") is False
            assert await a.compare_and_set("color", 2, "green") is True
            assert await b.get_versioned("color") == (3, b"green")
            assert await a.put_if_absent("color", "no") is False
            assert await a.put_if_absent("size", "L") is True
            assert await b.delete("color") is True
            assert await a.delete("color") is False
            assert await a.get("color") is None
            assert await a.compare_and_set("color", 0, "again") is True   # 0: absent
            assert await b.items() == [(b"color", 1, b"again"), (b"size", 1, b"L")]
        async with open_admin(coord) as adm:
            s = await adm.describe_stream("m")
            assert s.streamlets == 1 and s.groups == 1


async def test_bad_conditional_appends_are_refused_and_store_nothing(make_cluster):
    """append_if takes one chunk of one record with a current token; anything else gets a
    typed error, the streamlet is unchanged, and the broker serves the next request."""
    cluster = make_cluster(1)
    with trio.fail_after(60):
        async with open_kv("m", cluster.coordinator) as m:
            await m.put("k", "v")
            addr, s = m.log._owner()
            sid = s.id
            r, _ = await m.pool.call(addr, "tail", {"stream_id": sid, "streamlet": 0}, timeout=5)
            token = r["token"]
            mine = await producer_id(cluster.coordinator)   # a writer of our own, fresh
            pid = mine["producer"]
            one = chunk.build(sid, 0, pid, 0, [b"x"], [b"k"])
            cases = [
                ({"expect": token}, one + one, "invalid_argument"),                   # two chunks
                ({"expect": token}, chunk.build(sid, 0, pid, 0, [b"a", b"b"], [b"k", b"k"]),
                 "invalid_argument"),                                                 # two records
                ({"expect": [token[0], token[1] - 1]}, one, "conflict"),             # stale token
                ({"expect": "nonsense"}, one, "conflict"),
                ({}, one, "conflict"),
                ({"expect": token}, chunk.build(sid + 1000, 0, pid, 0, [b"x"], [b"k"]), "not_owner"),
                ({"expect": token}, b"garbage" * 20, "protocol"),
                ({"expect": token, "producer": pid + 1, "token": mine["token"]}, one,
                 "unauthorized"),                                   # an id not issued to us
            ]
            for meta, payload, code in cases:
                with pytest.raises(KeraError) as e:
                    await m.pool.call(addr, "append_if", {**mine, **meta}, payload, timeout=5)
                assert e.value.code == code, (meta, e.value)
            r, _ = await m.pool.call(addr, "tail", {"stream_id": sid, "streamlet": 0}, timeout=5)
            assert r["token"] == token, "a refused append changed the streamlet"
            assert await m.get("k") == b"v" and await m.put("k", "w") == 2


async def test_map_survives_a_broker_kill_without_losing_or_resurrecting(make_cluster):
    cluster = make_cluster(3)
    coord = cluster.coordinator
    with trio.fail_after(90):
        async with open_kv("m", coord) as m:
            for i in range(20):
                await m.put(f"k{i}", f"v{i}")
            for i in range(10):
                await m.delete(f"k{i}")
            owner = m.reader.streams["m"].addrs[0]
        name = next(n for n, a in cluster.addrs.items() if a == owner)
        cluster.kill(name)
        async with open_kv("m", coord) as m:
            got = {k.decode(): v.decode() for k, _, v in await m.items()}
            assert got == {f"k{i}": f"v{i}" for i in range(10, 20)}
            assert await m.put("k15", "new") == 2
        assert (await status(coord))["recoveries"][0]["state"] == "done"


def run_workers(cluster, name: str, seconds: float, n: int, tmp_path, reads="linearizable"):
    procs, outs = [], []
    for i in range(n):
        out = str(tmp_path / f"{name}-{i}.json")
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.kv_worker", cluster.coordinator, name,
                                       str(seconds), str(i), out, "--reads", reads],
                                      cwd=os.path.dirname(os.path.dirname(__file__))))
    return procs, outs


def history(procs, outs) -> list[Op]:
    for p in procs:
        assert p.wait(120) == 0
    out = []
    for i, path in enumerate(outs):
        with open(path) as f:
            for kind, key, arg, start, done, result in json.load(f):
                out.append(Op(i, kind, key, tuple(arg) if isinstance(arg, list) else arg, start, done,
                              result))
    return out


@pytest.mark.timeout(240)
async def test_concurrent_clients_through_a_broker_kill_and_a_pause_are_linearizable(make_cluster,
                                                                                       tmp_path):
    """8 processes, random put/get/cas/delete on 20 keys for 30 s; meanwhile the map's owner is
    killed and another broker paused. Every history is checked: it must be linearizable."""
    cluster = make_cluster(3)
    async with open_kv("lin", cluster.coordinator) as m:
        owner = m.reader.streams["lin"].addrs[0]
    procs, outs = run_workers(cluster, "lin", 30, 8, tmp_path)
    victim = next(n for n, a in cluster.addrs.items() if a == owner)
    paused = next(n for n in ("node1-broker", "node2-broker", "node3-broker") if n != victim)
    await trio.sleep(8)     # the fault schedule: part of the test, not synchronisation
    cluster.kill(victim)
    await trio.sleep(6)
    os.kill(cluster.procs[paused].pid, signal.SIGSTOP)
    await trio.sleep(3)
    os.kill(cluster.procs[paused].pid, signal.SIGCONT)
    h = await trio.to_thread.run_sync(history, procs, outs)
    answered = [op for op in h if op.done is not None]
    writes = [op for op in answered if op.kind != "get"]
    print(f"{len(h)} operations, {len(answered)} answered, {len(writes)} writes answered, "
          f"{len(h) - len(answered)} unknown")
    assert len(writes) > 200
    assert check(h) == []


@pytest.mark.timeout(120)
async def test_the_checker_catches_reads_that_skip_the_sync(make_cluster, tmp_path):
    """The same workload with reads served from each client's last read: flagged."""
    cluster = make_cluster(3)
    async with open_kv("stale", cluster.coordinator):
        pass
    procs, outs = run_workers(cluster, "stale", 8, 8, tmp_path, reads="local")
    h = await trio.to_thread.run_sync(history, procs, outs)
    assert check(h) != []


async def test_map_on_a_compacted_stream_stays_small_and_an_idle_client_rereads(make_cluster, monkeypatch):
    """The map's stream is compacted: many writes of few keys shrink to about one record per
    key, deletes stay deletes once their tombstones are gone, and a client idle past
    REREAD_AFTER reads the map again from its start instead of keeping a deleted key."""
    from kera_client import kv
    cluster = make_cluster(3)
    coord = cluster.coordinator
    with trio.fail_after(120):
        async with open_kv("m", coord) as a, open_kv("m", coord) as idle:
            async with open_admin(coord) as adm:
                s = await adm.describe_stream("m")
                assert s.cleanup_policy == "compact"
                await adm.alter_stream("m", segment_ms=300, delete_retention_ms=300)
            for i in range(50):
                for k in ("x", "y", "z"):
                    await a.put(k, f"{k}{i}")
            assert await idle.get("z") == b"z49"          # idle has read z before its delete
            await a.delete("z")
            while True:    # compaction removes the old versions, then the tombstone
                n = sum(len(ch) for ch in await read_to_end(coord, ["m"]))
                if n <= 2:
                    break
                await trio.sleep(0.2)
            monkeypatch.setattr(kv, "REREAD_AFTER", 0.0)
            assert await idle.items() == [(b"x", 50, b"x49"), (b"y", 50, b"y49")]
            async with open_kv("m", coord) as fresh:
                assert await fresh.items() == await a.items()
