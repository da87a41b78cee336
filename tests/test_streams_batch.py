"""Batch stream creation: many streams in one request, all or none, one assign per broker."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest
import trio
from kera_client import open_admin, open_consumer, open_producer

from kera import limits
from kera.errors import InvalidArgument, InvalidName, LimitExceeded, StreamExists
from kera.names import MAX_NAME


def test_batch_bounds_fit_a_frame_meta():
    """The byte budget per stream and per streamlet behind MAX_BATCH_STREAMS holds for the
    largest description: longest name, every field at its largest."""
    s = {"name": "n" * MAX_NAME, "id": 2**63 - 1, "streamlets": limits.MAX_STREAMLETS,
         "groups": limits.MAX_GROUPS, "replication": 2**31, "segment_size": limits.MAX_SEGMENT_SIZE,
         "group_segments": 2**31, "vlogs": "per-stream", "owners": [], "created": 1.5e9}
    assert len(msgpack.packb([s, []])) <= limits.BATCH_STREAM_BYTES
    owners = [[2**31, 2**31]] * limits.MAX_STREAMLETS
    grown = len(msgpack.packb([{**s, "owners": owners}, list(range(limits.MAX_STREAMLETS))]))
    assert grown - len(msgpack.packb([s, []])) <= limits.MAX_STREAMLETS * limits.BATCH_STREAMLET_BYTES


async def test_two_thousand_streams_in_one_call_then_a_record_each_way(make_cluster):
    cluster = make_cluster(2)
    with trio.fail_after(120):
        async with open_admin(cluster.coordinator) as a:
            names = [f"b{i:05d}" for i in range(2000)]
            created = await a.create_streams(names, replication=2)
            assert [c["name"] for c in created] == names
            assert len({c["id"] for c in created}) == 2000
            listed = await a.list_streams("b*")
            assert [s.name for s in listed] == names
            assert all(s.replication == 2 and all(s.addrs) for s in listed)
            # both brokers got a share
            assert len({s.addrs[0] for s in listed}) == 2
            mixed = await a.create_streams(["m1", {"name": "m2", "streamlets": 3}])
            assert [c["name"] for c in mixed] == ["m1", "m2"]
            assert (await a.describe_stream("m2")).streamlets == 3
        async with open_producer(cluster.coordinator) as p:
            for n in ("b00000", "b01999", "m2"):
                await p.send(n, n.encode())
            await p.flush()
            assert p.acked == 3 and p.failed == 0
        for n in ("b00000", "b01999", "m2"):
            async with open_consumer([n], cluster.coordinator) as c:
                got = []
                while not got:
                    got = [v for ch in await c.poll_chunks(1.0) for v in ch.values()]
                assert got == [n.encode()]


async def test_a_bad_entry_refuses_the_whole_batch_and_is_named(make_cluster):
    cluster = make_cluster(1)
    with trio.fail_after(60):
        async with open_admin(cluster.coordinator) as a:
            await a.create_stream("taken")
            cases = [
                (["ok-a", "bad name!", "ok-b"], InvalidName, 1, "bad name!"),
                (["ok-a", "ok-b", "taken"], StreamExists, 2, "taken"),
                (["ok-a", "ok-a"], InvalidArgument, 1, "ok-a"),
                (["ok-a", {"name": "big", "streamlets": limits.MAX_STREAMLETS + 1}], LimitExceeded, 1, "big"),
                (["ok-a", {"name": "zero", "groups": 0}], InvalidArgument, 1, "zero"),
            ]
            for batch, cls, index, name in cases:
                with pytest.raises(cls) as e:
                    await a.create_streams(batch)
                assert e.value.index == index and e.value.stream == name
                assert f"streams[{index}]" in str(e.value)
                assert [s.name for s in await a.list_streams()] == ["taken"]
            # over the batch bounds: refused as a whole, typed, naming the limit
            with pytest.raises(LimitExceeded) as e:
                await a.call("create_streams", streams=[{"name": f"x{i}"}
                                                        for i in range(limits.MAX_BATCH_STREAMS + 1)])
            assert e.value.limit == "MAX_BATCH_STREAMS"
            with pytest.raises(LimitExceeded) as e:
                await a.call("create_streams", streams=[{"name": f"y{i}", "streamlets": limits.MAX_STREAMLETS}
                                                        for i in range(17)])
            assert e.value.limit == "MAX_BATCH_STREAMLETS"
            assert [s.name for s in await a.list_streams()] == ["taken"]
            # the client splits what is over the bounds into several requests
            created = await a.create_streams([f"z{i:05d}" for i in range(limits.MAX_BATCH_STREAMS + 5)],
                                             streamlets=1)
            assert len(created) == limits.MAX_BATCH_STREAMS + 5
            assert len(await a.list_streams("z*")) == limits.MAX_BATCH_STREAMS + 5


def test_cli_creates_many_with_count_and_lists_one_per_line(make_cluster):
    cluster = make_cluster(1)
    env = dict(os.environ, KERA_COORDINATOR=cluster.coordinator)
    kera = [sys.executable, "-m", "kera"]
    r = subprocess.run(kera + ["stream", "create", "ev", "--count", "50", "--streamlets", "2"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("created 50 streams (ev-000000 ... ev-000049)")
    r = subprocess.run(kera + ["stream", "create", "a", "b", "c"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("created 3 streams (a ... c)"), r.stderr
    r = subprocess.run(kera + ["stream", "create", "d", "a"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "stream_exists" in r.stderr and "streams[1]" in r.stderr
    r = subprocess.run(kera + ["stream", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split("\t")[0] for ln in lines] == ["a", "b", "c"] + [f"ev-{i:06d}" for i in range(50)]
    assert lines[3].split("\t")[1:] == ["2 streamlets", "R=1"]


def test_cli_list_into_a_reader_that_stops_early_ends_quietly(make_cluster):
    """``kera stream list | head -1``: the closed pipe ends the command without a traceback."""
    cluster = make_cluster(1)
    env = dict(os.environ, KERA_COORDINATOR=cluster.coordinator)
    kera = [sys.executable, "-m", "kera"]
    r = subprocess.run(kera + ["stream", "create", "many", "--count", "4000"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # far more output than a pipe buffers: the writer meets the closed pipe for sure
    p = subprocess.Popen(kera + ["stream", "list"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("many-000000\t")
    p.stdout.close()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 141 and "Traceback" not in err, err
