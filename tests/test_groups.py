"""Consumer groups that stop anywhere, even inside a chunk, and continue exactly there;
keyed records from the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import trio

from .workload import create


def kera(cluster, *args, stdin: bytes = b"") -> str:
    env = dict(os.environ, KERA_COORDINATOR=cluster.coordinator)
    r = subprocess.run([sys.executable, "-m", "kera", *args], input=stdin, capture_output=True, env=env,
                       timeout=60, check=True)
    return r.stdout.decode()


async def test_a_group_continues_where_it_stopped_inside_chunks(make_cluster):
    cluster = make_cluster(3)
    await create(cluster.coordinator, ["g"], streamlets=3, replication=3)
    lines = b"".join(b"g-%d\n" % i for i in range(1000))
    await trio.to_thread.run_sync(lambda: kera(cluster, "produce", "g", stdin=lines))
    seen = []
    for n in (333, 333, 334):   # chunks hold many records: each stop falls inside one
        out = await trio.to_thread.run_sync(
            lambda n=n: kera(cluster, "consume", "g", "--group", "G", "--max", str(n), "--timeout", "10"))
        seen.append(out.split())
        assert len(seen[-1]) == n
    assert sorted(v for part in seen for v in part) == sorted(f"g-{i}" for i in range(1000))
    cluster.kill("node1-broker")   # positions are the group's, not a broker's
    more = b"".join(b"h-%d\n" % i for i in range(10))
    await trio.to_thread.run_sync(lambda: kera(cluster, "produce", "g", stdin=more))
    rest = await trio.to_thread.run_sync(
        lambda: kera(cluster, "consume", "g", "--group", "G", "--max", "10", "--timeout", "20"))
    assert sorted(rest.split()) == sorted(f"h-{i}" for i in range(10))   # the new ones, only
    other = await trio.to_thread.run_sync(
        lambda: kera(cluster, "consume", "g", "--group", "H", "--max", "1010", "--timeout", "20"))
    assert sorted(other.split()) == sorted([f"g-{i}" for i in range(1000)] + rest.split())


async def test_keyed_lines_in_and_out(make_cluster):
    cluster = make_cluster(1)
    await create(cluster.coordinator, ["c"], streamlets=1, replication=1)
    out = await trio.to_thread.run_sync(lambda: kera(cluster, "produce", "c", "--keyed",
                                                     stdin=b"a\t1\nb\t2\na\t3\nb\t\n"))
    assert out.strip() == "acknowledged: 4"
    got = await trio.to_thread.run_sync(lambda: kera(cluster, "consume", "c", "--keys", "--max", "4"))
    assert got == "a\t1\nb\t2\na\t3\nb\t\n"
    # a line without a key: that line is refused, the others still go, the status says so
    env = dict(os.environ, KERA_COORDINATOR=cluster.coordinator)
    r = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "kera", "produce", "c", "--keyed"], input=b"c\t4\nno-tab\nd\t5\n",
        capture_output=True, env=env, timeout=60))
    assert r.returncode == 1 and b"line 2: --keyed needs key<TAB>value" in r.stderr
    assert r.stdout.decode().strip() == "acknowledged: 2"
