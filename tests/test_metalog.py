"""The coordinator's metadata log: replay, torn tails, corruption, snapshots, migration,
and a real coordinator keeping its streams and positions across kill -9."""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kera_client import open_admin

from kera import metafile
from kera.coordinator.metalog import CorruptMetaLog, MetaLog, frame, scan

from .conftest import free_port

INITIAL = {"next": 1, "streams": {}, "positions": {}}


def log_files(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("meta-"))


def records(path) -> list:
    with open(path, "rb") as f:
        bodies, end, bad = scan(f.read())
    assert bad is None
    return bodies


async def write(d, batches, **kw) -> MetaLog:
    """Each batch: changes recorded in one go, then committed."""
    m = MetaLog(str(d), INITIAL, **kw)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(m.run)
            for batch in batches:
                for kind, *args in batch:
                    getattr(m, kind)(*args)
                await m.commit()
            n.cancel_scope.cancel()
    m.close()
    return m


def reopen(d, **kw) -> MetaLog:
    m = MetaLog(str(d), INITIAL, **kw)
    m.close()
    return m


def stream(i) -> dict:
    return {"name": f"s{i}", "id": i, "owners": [[1, 1]]}


async def test_replay_set_delete_merge(tmp_path):
    m = await write(tmp_path, [
        [("set", ("streams", "a"), stream(1)), ("set", ("next",), 2)],
        [("set", ("streams", "b"), stream(2)), ("set", ("streams", "b", "owners", 0), [2, 5])],
        [("delete", ("streams", "a")), ("merge", ("positions", "g"), {"b/0": 7})],
        [("merge", ("positions", "g"), {"b/1": 9})],
    ])
    want = {"next": 2, "streams": {"b": {"name": "s2", "id": 2, "owners": [[2, 5]]}},
            "positions": {"g": {"b/0": 7, "b/1": 9}}}
    assert m.state == want
    again = reopen(tmp_path)
    assert again.state == want and again.cut == []


async def test_value_is_packed_when_recorded(tmp_path):
    s = stream(1)
    m = MetaLog(str(tmp_path), INITIAL)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(m.run)
            m.set(("streams", "a"), s)
            s["owners"] = [[9, 9]]   # an in-place edit that was not recorded
            await m.commit()
            n.cancel_scope.cancel()
    m.close()
    assert reopen(tmp_path).state["streams"]["a"]["owners"] == [[1, 1]]


async def test_group_commit_many_changes_one_record(tmp_path):
    """Changes made by many tasks in one event-loop turn share a record (one fsync)."""
    m = MetaLog(str(tmp_path), INITIAL)

    async def create(i):
        m.set(("streams", f"s{i}"), stream(i))
        await m.commit()

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(m.run)
            async with trio.open_nursery() as creates:
                for i in range(300):
                    creates.start_soon(create, i)
            n.cancel_scope.cancel()
    m.close()
    assert len(records(tmp_path / "meta-000000.log")) <= 3
    assert len(reopen(tmp_path).state["streams"]) == 300


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zeros"])
async def test_torn_tail_is_cut(tmp_path, damage):
    await write(tmp_path, [[("set", ("streams", f"s{i}"), stream(i))] for i in range(5)])
    path = tmp_path / "meta-000000.log"
    size = path.stat().st_size
    last = size - len(records(path)[-1]) - 16
    if damage == "garbage":
        with open(path, "ab") as f:
            f.write(b"KML1\xff\xff" + os.urandom(30))
        keep, good = 5, size
    elif damage == "zeros":
        with open(path, "ab") as f:
            f.write(bytes(4096))
        keep, good = 5, size
    else:
        os.truncate(path, size - 3)
        keep, good = 4, last
    m = reopen(tmp_path)
    assert sorted(m.state["streams"]) == [f"s{i}" for i in range(keep)]
    assert len(m.cut) == 1 and m.cut[0].offset == good
    assert path.stat().st_size == good
    # the log goes on after the cut, and replays cleanly
    m = await write(tmp_path, [[("set", ("streams", "new"), stream(99))]])
    again = reopen(tmp_path)
    assert again.cut == [] and len(again.state["streams"]) == keep + 1


async def test_corrupt_record_in_the_middle_is_refused(tmp_path):
    """A bad record followed by valid ones: acknowledged changes are damaged, so opening
    fails loudly instead of skipping them or cutting the valid ones after it."""
    await write(tmp_path, [[("set", ("streams", f"s{i}"), stream(i))] for i in range(5)])
    path = tmp_path / "meta-000000.log"
    before = path.read_bytes()
    damaged = bytearray(before)
    damaged[20] ^= 0x40   # inside the first record's body
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptMetaLog, match="followed by a valid"):
        reopen(tmp_path)
    assert path.read_bytes() == bytes(damaged)   # nothing cut


async def test_snapshot_then_log_goes_on(tmp_path):
    batches = [[("set", ("streams", f"s{i}"), stream(i)), ("set", ("next",), i + 1)]
               for i in range(400)]
    batches += [[("delete", ("streams", f"s{i}"))] for i in range(0, 400, 3)]
    batches += [[("merge", ("positions", "g"), {f"s{i}/0": i})] for i in range(50)]
    m = await write(tmp_path, batches, min_log=2000, ratio=1.0)
    files = log_files(tmp_path)
    assert any(f.endswith(".snap") for f in files), files
    gens = {f.split(".")[0] for f in files}
    assert len(gens) <= 2, files   # older generations removed
    again = reopen(tmp_path)
    assert again.state == m.state
    assert len(again.state["streams"]) == 400 - len(range(0, 400, 3))
    assert again.state["next"] == 400 and len(again.state["positions"]["g"]) == 50


async def test_packed_entries_leave_the_files_as_they_were(tmp_path):
    """A packed map's entries are its msgpack bytes in memory and plain maps on disk: a
    store that packs and one that does not read each other's logs and snapshots, a change
    below an entry repacks it, and the writer's snapshot copy shares the entries."""
    batches = [[("set", ("streams", f"s{i}"), stream(i)), ("set", ("next",), i + 1)] for i in range(300)]
    batches += [[("set", ("streams", f"s{i}", "owners", 0), [2, i])] for i in range(0, 300, 7)]
    batches += [[("delete", ("streams", f"s{i}"))] for i in range(0, 300, 5)]
    plain = await write(tmp_path / "plain", batches)
    packed = await write(tmp_path / "packed", batches, packed=("streams",), min_log=4000, ratio=1.0)
    assert any(f.endswith(".snap") for f in log_files(tmp_path / "packed"))
    unpacked = {n: msgpack.unpackb(b) for n, b in packed.state["streams"].items()}
    assert unpacked == plain.state["streams"] and {**packed.state, "streams": unpacked} == plain.state
    assert all(packed._shadow["streams"][n] is b for n, b in packed.state["streams"].items())
    for d in ("plain", "packed"):
        assert reopen(tmp_path / d).state == plain.state
        assert reopen(tmp_path / d, packed=("streams",)).state == packed.state


def test_interrupted_snapshot_replays_both_logs(tmp_path):
    """Log G+1 was started but snapshot G+1 never finished: both logs are replayed."""
    def put(gen, changes):
        with open(tmp_path / f"meta-{gen:06d}.log", "wb") as f:
            for c in changes:
                f.write(frame(msgpack.packb(c, use_bin_type=True)))
    put(0, [("set", ("streams", "a"), stream(1)), ("set", ("next",), 5)])
    put(1, [("set", ("streams", "b"), stream(2)), ("del", ("streams", "a"))])
    (tmp_path / "meta-000001.snap.tmp").write_bytes(b"half a snapshot")
    m = reopen(tmp_path)
    assert m.state == {"next": 5, "streams": {"b": stream(2)}, "positions": {}}
    assert log_files(tmp_path) == ["meta-000002.log", "meta-000002.snap"]
    assert reopen(tmp_path).state == m.state


def test_missing_snapshot_is_refused(tmp_path):
    (tmp_path / "meta-000003.log").write_bytes(b"")
    with pytest.raises(CorruptMetaLog):
        reopen(tmp_path)


async def test_migration_from_the_whole_file(tmp_path):
    old = {"next": 7, "streams": {"x": stream(3)}, "positions": {"g": {"x/0": 1}}}
    legacy = str(tmp_path / "coordinator.meta")
    metafile.save(legacy, old)
    m = MetaLog(str(tmp_path), {**INITIAL, "fences": {}}, legacy=legacy)
    m.close()
    assert m.state == {**old, "fences": {}}   # a key the old file lacked gets its initial value
    assert not os.path.exists(legacy)
    assert log_files(tmp_path) == ["meta-000001.log", "meta-000001.snap"]
    m = MetaLog(str(tmp_path), {**INITIAL, "fences": {}}, legacy=legacy)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(m.run)
            m.set(("fences", "2"), 4)   # the new key is in the writer's copy too
            await m.commit()
            n.cancel_scope.cancel()
    m.close()
    again = MetaLog(str(tmp_path), {**INITIAL, "fences": {}})
    again.close()
    assert again.state == {**old, "fences": {"2": 4}}


# -- any cut of the log replays a prefix of the batches ------------------------------------

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefix")
    batches = [[("set", ("streams", f"s{i}"), stream(i)), ("set", ("next",), i)] for i in range(30)]
    batches += [[("delete", ("streams", f"s{i}"))] for i in range(0, 30, 4)]
    states, state = [], {k: (dict(v) if isinstance(v, dict) else v) for k, v in INITIAL.items()}
    states.append(repr(state))
    for b in batches:
        for kind, path, *v in b:
            if kind == "set":
                (state["streams"] if len(path) == 2 else state)[path[-1]] = v[0]
            else:
                del state["streams"][path[-1]]
        states.append(repr(state))
    trio.run(write, d, batches)
    path = d / "meta-000000.log"
    ends, off = [], 0
    for body in records(path):
        off += 16 + len(body)
        ends.append(off)
    return d, path.read_bytes(), ends, states


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_truncation_replays_a_prefix(tmp_path_factory, written, data):
    _, log, ends, states = written
    cut = data.draw(st.integers(0, len(log)))
    d = tmp_path_factory.mktemp("cut")
    (d / "meta-000000.log").write_bytes(log[:cut])
    whole = sum(1 for e in ends if e <= cut)
    m = reopen(d)
    assert repr(m.state) == states[whole]
    assert (m.cut == []) == (cut in (0, *ends))
    shutil.rmtree(d)


# -- a real coordinator --------------------------------------------------------------------

async def _create(coord, names):
    async with open_admin(coord) as a:
        async with trio.open_nursery() as n:
            for name in names:
                n.start_soon(lambda s: a.create_stream(s, replication=1), name)


async def _listed(coord) -> set:
    async with open_admin(coord) as a:
        return {s.name for s in await a.list_streams()}


@pytest.mark.parametrize("tail", [b"", b"KML1\x10\x00\x00\x00torn"])
async def test_coordinator_keeps_streams_across_kill9(make_cluster, tail):
    cluster = make_cluster(1, port=free_port())
    names = [f"k{i:03d}" for i in range(150)]
    with trio.fail_after(120):
        await _create(cluster.coordinator, names)
        cluster.kill("coordinator")
        meta_dir = os.path.join(cluster.data, "coordinator")
        logs = [n for n in log_files(meta_dir) if n.endswith(".log")]
        with open(os.path.join(meta_dir, logs[-1]), "ab") as f:
            f.write(tail)   # a write the kill tore
        cluster.restart("coordinator")
        assert await _listed(cluster.coordinator) == set(names)
        if tail:
            assert "torn tail cut" in cluster.log("coordinator")
        # and it goes on: a new stream after the restart is kept too
        async with open_admin(cluster.coordinator) as a:
            await a.create_stream("after", replication=1)
        cluster.kill("coordinator")
        cluster.restart("coordinator")
        assert await _listed(cluster.coordinator) == {*names, "after"}
