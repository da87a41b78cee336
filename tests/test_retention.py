"""Retention, reclaiming and reads of evicted data, on real processes.

- a scaled-down soak: brokers with a 32 MiB budget keep streams whose retained
  data is larger than that; a consumer from earliest reads the whole retained
  range, most of it read back from the backups' disks, exactly once and in order;
- retention.ms expiry and stream deletion free broker memory (the broker's own
  accounting and its RSS) and delete segment files on the backups (on disk);
- a reader positioned before the retained range gets out_of_range, or restarts at
  the earliest retained record (auto.offset.reset).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import numpy as np
import pytest
import trio
from kera_client import open_admin, open_consumer, open_producer
from kio.schema.errors import ErrorCode

from kera import chunk
from kera.backup.segment_file import file_name
from kera.broker.memory import LOW_WATER
from kera.errors import Fenced, InvalidArgument, NotOwner, OutOfRange, ProtocolError, Unavailable
from kera.process import free_ports
from kera.recovery.state import PHASES
from kera.rpc import open_pool

from .conftest import free_port
from .damage import flip_middle
from .members import open_members
from .test_replication import backup_listings
from .workload import values

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

MiB = 1 << 20
SIZE = 1000


def counters(chunk) -> np.ndarray:
    data = np.frombuffer(chunk.view.value_data, np.uint8).reshape(-1, SIZE)
    return data[:, 4:12].copy().view("<u8").ravel()


async def produce(coord, stream: str, n: int, start: int = 0, step: int = 5000) -> None:
    async with open_producer(coord, **{"linger.ms": 2}) as p:
        for at in range(start, start + n, step):
            await p.send_many(stream, values(0, at, min(step, start + n - at), SIZE))
        await p.flush()
        assert p.acked == n


async def read_all(coord, streams, idle: float = 5.0, want: int | None = None, **kw) -> dict:
    """Every stream's counters from earliest, until nothing new came for ``idle`` seconds
    (or, given ``want``, once that many records were read)."""
    got: dict[str, list] = {s: [] for s in streams}
    n = 0
    async with open_consumer(streams, coord, start="earliest", **kw) as c:
        quiet_until = trio.current_time() + idle
        while trio.current_time() < quiet_until and (want is None or n < want):
            chunks = await c.poll_chunks(1.0)
            if chunks:
                quiet_until = trio.current_time() + idle
            for ch in chunks:
                got[ch.stream].append(counters(ch))
                n += len(ch)
    return {s: np.concatenate(v) if v else np.zeros(0, np.uint64) for s, v in got.items()}


async def wait_for(cond, what: str, timeout: float = 30.0, every: float = 0.2):
    """Poll ``cond`` (async) until it is truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        r = await cond()
        if r:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.sleep(every)


def seg_files(cluster) -> list[str]:
    out = []
    for root, _, files in os.walk(cluster.data):
        out += [os.path.join(root, f) for f in files if f.endswith(".seg")]
    return out


def disk_bytes(cluster) -> int:
    total = 0
    for f in seg_files(cluster):
        try:
            total += os.path.getsize(f)
        except FileNotFoundError:  # deleted by a trim since it was listed
            pass
    return total


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_soak_small_budget_reads_evicted_range_once_in_order(make_cluster):
    """3 streams of 80 MiB retention each on brokers with a 32 MiB budget; 160 MB per stream
    ingested. Each stream's retained suffix is read back exactly once, in order, most of it
    from backups (evicted), and no broker ever holds more than its budget."""
    budget = 32 * MiB
    c = make_cluster(3, broker_args=["--memory", str(budget), "--vseg-size", str(1 * MiB)])
    streams = ["soak-0", "soak-1", "soak-2"]
    retention = 80 * MiB
    n = 160_000  # 160 MB of 1000-byte records per stream: 5x the budget each

    async def main():
        async with open_admin(c.coordinator) as a:
            await a.create_streams(streams, streamlets=1, replication=3, segment_size=256 << 10,
                                   group_segments=4, retention_bytes=retention)
        t0 = time.monotonic()
        async with trio.open_nursery() as nursery:
            for s in streams:
                nursery.start_soon(produce, c.coordinator, s, n)
        ingest = time.monotonic() - t0

        async def settled():  # retention and eviction passes caught up with the ingest
            async with open_admin(c.coordinator) as a:
                stats = await a.broker_stats(streams=True)
            ok = all(sum(e["retained"] for e in b["streams"].values()) <= retention + 2 * MiB
                     for b in stats)
            return stats if ok and len(stats) == 3 else None

        stats = await wait_for(settled, "retention to free the oldest segments")
        t1 = time.monotonic()
        got = await read_all(c.coordinator, streams)
        read_s = time.monotonic() - t1
        async with open_admin(c.coordinator) as a:
            after = await a.broker_stats()
        return ingest, stats, got, read_s, after

    ingest, stats, got, read_s, after = trio.run(main)
    total = 0
    for s in streams:
        arr = got[s]
        assert len(arr), f"{s}: nothing read"
        first = int(arr[0])
        # the retained suffix, exactly once and in order
        assert (arr == np.arange(first, n, dtype=np.uint64)).all(), f"{s}: not the suffix {first}..{n}"
        assert len(arr) * (SIZE + 64) >= retention, f"{s}: only {len(arr)} records kept"  # + chunk overhead
        assert len(arr) * SIZE <= retention + 2 * MiB, f"{s}: {len(arr)} records kept, retention is 80 MiB"
        total += len(arr)
    for b in stats:
        assert b["memory"] <= budget, b
        assert b["evictions"] > 0, "a broker holding more than its budget evicted nothing"
    tiered = sum(b["tiered_bytes"] for b in after)
    assert tiered > total * SIZE // 2, "most of the retained range was read back from backups"
    print(f"\ningested {3 * n * SIZE / MiB:.0f} MiB in {ingest:.1f} s; read {total} records "
          f"({total * SIZE / MiB:.0f} MiB, {tiered / MiB:.0f} MiB from backups) from earliest in "
          f"{read_s:.1f} s: {total * SIZE / MiB / read_s:.1f} MiB/s; evictions "
          f"{sum(b['evictions'] for b in after)}")


def test_retention_ms_and_delete_free_broker_memory_and_backup_files(make_cluster):
    """Two idle streams of ~24 MB each on a one-node cluster: lowering one's retention.ms
    frees its segments (all but the one still open) in the broker; deleting the other frees
    the rest, and the backup files holding them are deleted. Measured from the broker's RSS
    and the segment files on disk, with the broker's own accounting beside."""
    c = make_cluster(1, broker_args=["--vseg-size", str(1 * MiB), "--vlogs", "1"])
    broker_pid = c.procs["node1-broker"].pid
    n = 24_000

    async def memory():
        async with open_admin(c.coordinator) as a:
            (b,) = await a.broker_stats(streams=True)
        return b

    async def main():
        async with open_admin(c.coordinator) as a:
            await a.create_streams(["keep", "drop"], streamlets=1, replication=1,
                                   segment_size=256 << 10, group_segments=4)
        base_rss = rss(broker_pid)
        await produce(c.coordinator, "drop", n)
        await produce(c.coordinator, "keep", n)
        full = await memory()
        full_rss, full_disk = rss(broker_pid), disk_bytes(c)
        async with open_admin(c.coordinator) as a:
            s = await a.alter_stream("keep", retention_ms=500)
            assert s.retention_ms == 500
            with pytest.raises(InvalidArgument):
                await a.alter_stream("keep", retention_ms=-5)
            assert (await a.describe_stream("keep")).retention_ms == 500  # nothing changed

        async def keep_expired():
            b = await memory()
            (kept,) = [e for sid, e in b["streams"].items() if e["retained"] < 512 << 10] or [None]
            return b if kept is not None else None

        expired = await wait_for(keep_expired, "retention.ms to free stream keep")
        # its files go once the vsegs below them hold nothing live either: stream drop's,
        # written before into the same vlog, pin them until it is deleted
        mid_rss = rss(broker_pid)
        async with open_admin(c.coordinator) as a:
            await a.delete_stream("drop")

        async def dropped():
            b = await memory()
            return b if not b["streams"] or len(b["streams"]) == 1 else None

        gone = await wait_for(dropped, "deletion to free stream drop")

        async def files_gone():  # all but the vsegs holding keep's open segment
            return disk_bytes(c) < 3 * MiB

        await wait_for(files_gone, "backup files of the freed vsegs to be deleted")
        return base_rss, full, full_rss, full_disk, expired, mid_rss, gone

    base_rss, full, full_rss, full_disk, expired, mid_rss, gone = trio.run(main)
    end_rss, end_disk = rss(broker_pid), disk_bytes(c)
    assert full["memory"] >= 2 * n * SIZE * 0.9
    assert expired["memory"] < full["memory"] * 0.6, "retention.ms freed little of the broker's memory"
    assert gone["memory"] <= 2 * (256 << 10), "deletion left segments in the broker's memory"
    # from the process and the disk, not counters alone
    assert full_rss - end_rss > n * SIZE, f"broker RSS {full_rss >> 20} -> {end_rss >> 20} MiB"
    assert full_disk > 2 * n * SIZE * 0.9 and end_disk < 3 * MiB, (full_disk, end_disk)
    print(f"\nbroker RSS {base_rss / MiB:.0f} MiB empty, {full_rss / MiB:.0f} MiB with 2 x 24 MB, "
          f"{mid_rss / MiB:.0f} after retention.ms, {end_rss / MiB:.0f} after delete; backup files "
          f"{full_disk / MiB:.1f} -> {end_disk / MiB:.2f} MiB")


def test_reader_before_retained_range_gets_out_of_range_or_resets(make_cluster):
    """A consumer positioned in freed segments: with auto_offset_reset='none' it gets the
    typed error; by default it continues at the first retained record."""
    c = make_cluster(1, broker_args=["--vseg-size", str(256 << 10)])

    async def main():
        async with open_admin(c.coordinator) as a:
            await a.create_stream("r", streamlets=1, replication=1, segment_size=64 << 10,
                                  group_segments=4, retention_bytes=256 << 10)
        await produce(c.coordinator, "r", 500, step=50)
        async with open_consumer(["r"], c.coordinator, start="earliest") as early:
            first = counters((await early.poll_chunks(5.0))[0])
            saved = early.position()
        assert first[0] == 0
        await produce(c.coordinator, "r", 2000, start=500, step=50)

        async def freed():
            async with open_admin(c.coordinator) as a:
                (b,) = await a.broker_stats(streams=True)
            return all(st[1] > 0 or st[0] > 0 for e in b["streams"].values()
                       for st in e["starts"].values())

        await wait_for(freed, "retention to free the first segments")
        start = {("r", 0): {"low": saved["r/0"]["low"],
                            "groups": {int(g): v for g, v in saved["r/0"]["groups"].items()}}}
        async with open_consumer(["r"], c.coordinator, start=start, auto_offset_reset="none") as strict:
            with pytest.raises(OutOfRange):
                await strict.poll_chunks(3.0)
        async with open_consumer(["r"], c.coordinator, start=start) as lenient:
            chunks = await lenient.poll_chunks(5.0)
            assert lenient.resets == 1
        return counters(chunks[0])

    got = trio.run(main)
    assert got[0] > 0, "the reset consumer did not skip the freed records"


@pytest.mark.parametrize("index", ["newest_per_chunk", "runs_throughout", "runs_second_round_fails"])
def test_kill_broker_holding_more_than_its_budget_recovers_retained_range(make_cluster, monkeypatch, index):
    """kill -9 the broker of a stream retaining 48 MiB with a 32 MiB budget (most of it
    evicted): the recovery completes into another broker with the same budget, and the
    whole retained range is read back exactly once and in order. Planned from runs of chunks
    throughout (``--chunk-rows-newest 0``), the segments of the groups the replay continues
    get their chunks' own rows in a second round, and the result is the same; when that
    round fails (failpoint ``repoint.chunk_rows``), the settled prefix ends at those
    segments, planned again, and they are replayed."""
    budget = 32 * MiB
    runs = ["--chunk-rows-newest", "0"] if index != "newest_per_chunk" else []
    if index == "runs_second_round_fails":
        monkeypatch.setenv("KERA_FAILPOINTS", "repoint.chunk_rows=error")
    c = make_cluster(3, broker_args=["--memory", str(budget), "--vseg-size", str(1 * MiB)],
                     coordinator_args=["--dead-after", "2.0", *runs])
    monkeypatch.delenv("KERA_FAILPOINTS", raising=False)
    retention = 48 * MiB
    n = 64_000

    async def main():
        async with open_admin(c.coordinator) as a:
            s = await a.create_stream("big", streamlets=1, replication=3, segment_size=256 << 10,
                                      group_segments=4, retention_bytes=retention)
        await produce(c.coordinator, "big", n)

        async def evicted():
            async with open_admin(c.coordinator) as a:
                stats = await a.broker_stats(streams=True)
            return any(b["evictions"] and b["streams"] for b in stats)

        await wait_for(evicted, "the owner to evict part of the stream")
        victim = next(name for name, addr in c.addrs.items() if addr == s.addrs[0])
        c.kill(victim)
        t0 = time.monotonic()

        rec = await wait_recovered(c, s, timeout=120)
        took = time.monotonic() - t0
        got = await read_all(c.coordinator, ["big"])
        async with open_admin(c.coordinator) as a:
            stats = await a.broker_stats()
        return rec, took, got["big"], stats

    rec, took, arr, stats = trio.run(main)
    assert not rec["lost"], rec
    assert rec["index_chunks"] > rec["index_rows"] > 0, rec   # one producer's chunks: runs
    assert (rec["reindexed_vsegs"] > 0) == bool(runs), rec
    log = c.log("coordinator")
    failed = "disagree with the runs planned from, or could not be had" in log
    assert failed == (index == "runs_second_round_fails")
    assert not failed or "failed, will retry" not in log   # planned again, not a new attempt
    assert len(arr) and (arr == np.arange(int(arr[0]), n, dtype=np.uint64)).all(), "not the retained suffix"
    assert len(arr) * (SIZE + 64) >= retention
    assert all(b["memory"] <= budget for b in stats)
    print(f"\nrecovery of {rec['bytes'] / MiB:.1f} MiB in {rec['seconds']} s ({took:.1f} s from the kill "
          f"to the hand-over seen); {len(arr)} retained records read back; planned from "
          f"{rec['index_rows']} rows for {rec['index_chunks']} chunks, {rec['reindexed_vsegs']} vsegs "
          f"asked again")


async def wait_recovered(c, s: dict, timeout: float, dead: int | None = None) -> dict:
    """The done recovery of the broker that owned streamlet 0 of ``s`` (id ``dead``, looked up
    by address if not given), once a new owner serves it."""
    async def recovered():
        async with open_admin(c.coordinator) as a:
            st = await a.status()
            d = await a.describe_stream(s.name)
        victim_id = dead if dead is not None else next(
            b["id"] for b in st["brokers"] if b["addr"] == s.addrs[0])
        done = [r for r in st["recoveries"] if r["state"] == "done" and r["broker"] == victim_id]
        return done[0] if done and d.addrs[0] not in (None, s.addrs[0]) else None

    return await wait_for(recovered, "the recovery of the killed broker", timeout=timeout)


async def _lose_owner_of_history(c, history: int, budget: int) -> tuple[dict, dict, int]:
    """Stream "big" retaining ``history`` bytes, written until its owner evicted all but its
    budget; the owner is killed with -9. Returns the stream as it was, the recovery, and the
    dead broker's id."""
    s, dead = await _kill_owner_of_history(c, history, budget)
    return s, await wait_recovered(c, s, timeout=60), dead


async def _kill_owner_of_history(c, history: int, budget: int, group_segments: int = 32) -> tuple[dict, int]:
    """``_lose_owner_of_history`` up to the kill: the stream as it was, the dead broker's id."""
    n = history // SIZE
    async with open_admin(c.coordinator) as a:
        s = await a.create_stream("big", streamlets=1, replication=3, segment_size=256 << 10,
                                  group_segments=group_segments, retention_bytes=n * SIZE)
    await produce(c.coordinator, "big", n, step=2000)
    victim = next(name for name, addr in c.addrs.items() if addr == s.addrs[0])

    async def held():
        async with open_admin(c.coordinator) as a:
            stats = await a.broker_stats(streams=True)
        mine = [b for b in stats if b["streams"]]
        return mine and mine[0]["evicted_bytes"] >= history - 3 * budget

    await wait_for(held, "the owner to evict all but its budget")
    async with open_admin(c.coordinator) as a:
        dead = next(b["id"] for b in (await a.status())["brokers"] if b["addr"] == s.addrs[0])
    c.kill(victim)
    return s, dead


def _history_cluster(make_cluster, budget: int):
    return make_cluster(3, broker_args=["--memory", str(budget), "--vseg-size", str(1 * MiB)])


def _check_suffix(arr, end: int, retention: int) -> None:
    assert len(arr) and (arr == np.arange(int(arr[0]), end, dtype=np.uint64)).all(), "not the retained suffix"
    assert len(arr) * (SIZE + 64) >= retention, "records of the retained range are missing"


def _recover_repointed(make_cluster, history: int) -> dict:
    """A broker with an 8 MiB budget holding ``history`` retained bytes is killed with -9;
    the recovery re-points its settled segments. Returns the recovery's figures."""
    budget = 8 * MiB
    c = _history_cluster(make_cluster, budget)

    async def main():
        _, rec, _ = await _lose_owner_of_history(c, history, budget)
        got = await read_all(c.coordinator, ["big"], idle=2.0)
        async with open_admin(c.coordinator) as a:
            stats = await a.broker_stats()
        return rec, got["big"], stats

    rec, arr, stats = trio.run(main)
    assert not rec["lost"], rec
    _check_suffix(arr, history // SIZE, history // SIZE * SIZE)
    assert all(b["memory"] <= budget for b in stats)
    return {**rec, "records": len(arr)}


def test_kill_broker_with_4x_history_replays_what_it_held_not_its_history(make_cluster):
    """kill -9 a broker holding 3x, then 12x its memory budget of retained data: with
    re-pointing, the bytes replayed into memory stay about the same (the evicted, settled
    history is handed over as index rows), and every retained record reads back once, in
    order, most of it from the dead broker's backups' copies."""
    one = _recover_repointed(make_cluster, 24 * MiB)
    four = _recover_repointed(make_cluster, 96 * MiB)
    for name, r in (("1x", one), ("4x", four)):
        print(f"\n{name}: serving after {r['serve_seconds']} s, recovery in {r['seconds']} s: "
              f"{r['bytes'] / MiB:.1f} MiB replayed, {r['adopted_bytes'] / MiB:.1f} MiB in "
              f"{r['adopted_segments']} segments re-pointed; {r['records']} records read back\n"
              f"  phases, s (coordinator CPU ms): " + ", ".join(
                  f"{p} {r[f'{p}_seconds']} ({r['cpu_ms'][p]})" for p in PHASES)
              + f"; settle beside the replay {r['settle_seconds']} s")
    assert four["adopted_bytes"] > 3 * one["adopted_bytes"] > 0
    assert four["bytes"] <= one["bytes"] + 1 * MiB, (one, four)  # closed groups re-pointed whole
    assert four["bytes"] < 96 * MiB / 4


@pytest.mark.parametrize("second_by", ["index", "replay"])
def test_new_owner_killed_too_readopts_from_its_index_chunks(make_cluster, second_by):
    """kill -9 the owner of a stream whose history was mostly evicted, then kill -9 the new
    owner once it adopted that history: the second recovery adopts it again from the index
    chunks in the new owner's vlogs (naming the first owner's copies), whether they come
    from the backups' index of settled vsegs or, with re-pointing turned off (coordinator
    restarted with --no-repoint-evicted), replayed like any chunk; every retained
    acknowledged record reads back exactly once, in order."""
    budget, history = 8 * MiB, 24 * MiB
    c = make_cluster(3, broker_args=["--memory", str(budget), "--vseg-size", str(1 * MiB)],
                     port=free_port())

    async def main():
        _, first, _ = await _lose_owner_of_history(c, history, budget)
        async with open_admin(c.coordinator) as a:
            s = await a.describe_stream("big")
        if second_by == "replay":
            c.specs["coordinator"] = [*c.specs["coordinator"], "--no-repoint-evicted"]
            c.restart("coordinator")
            await _rejoined(c, brokers=2, backups=3)
        c.kill(next(name for name, addr in c.addrs.items() if addr == s.addrs[0]))
        second = await wait_recovered(c, s, timeout=60)
        got = await read_all(c.coordinator, ["big"], idle=2.0)
        return first, second, got["big"]

    first, second, arr = trio.run(main)
    assert not first["lost"] and not second["lost"], (first, second)
    assert first["adopted_segments"] > 0
    if second_by == "index":
        assert second["adopted_segments"] >= first["adopted_segments"], (first, second)
    else:  # the index chunks were replayed: their segments' bytes were not
        assert second["adopted_segments"] == 0 and second["bytes"] < history / 2, (first, second)
    _check_suffix(arr, history // SIZE, history // SIZE * SIZE)
    print(f"\nfirst recovery: {first['adopted_segments']} segments adopted in {first['seconds']} s; "
          f"second: {second['adopted_segments']} adopted again, {second['bytes'] / MiB:.1f} MiB "
          f"replayed, in {second['seconds']} s; {len(arr)} records read back")


@pytest.mark.parametrize("fault", ["error", "new_owner_killed", "coordinator_killed"])
def test_closed_history_adopted_after_the_hand_over_survives_a_cut(make_cluster, monkeypatch, tmp_path, fault):
    """The closed groups of a dead broker's history are adopted after the new owner serves
    (``kera.adoption``). Cut that adoption short right after the owner adopted them, before
    they are durable and claimed (failpoint ``adoption.adopted``): the attempt fails, the
    new owner is killed with -9, or the coordinator is. Meanwhile the streamlet serves:
    new records are acknowledged, and a consumer from earliest gets nothing (reads that
    reach the pending history wait, they never skip it). The adoption is done again (from
    the record the hand-over committed: by the successor of the killed owner, by the
    coordinator's new term), and every retained acknowledged record reads back exactly
    once, in order."""
    budget, history = 8 * MiB, 24 * MiB
    n, extra = history // SIZE, 5000
    start, gate = str(tmp_path / "start"), str(tmp_path / "adopted")
    monkeypatch.setenv("KERA_FAILPOINTS", f"adoption.start=pause({start});adoption.adopted=" + (
        "error" if fault == "error" else f"pause({gate})"))
    c = make_cluster(3, broker_args=["--memory", str(budget), "--vseg-size", str(1 * MiB)],
                     port=free_port())
    monkeypatch.delenv("KERA_FAILPOINTS")   # processes started from here on run without it

    async def main():
        # groups of 2 MiB: most of them closed, so adopted after the hand-over
        s, dead = await _kill_owner_of_history(c, history, budget, group_segments=8)
        rec = await wait_recovered(c, s, timeout=60, dead=dead)
        # served, the adoption not started: what the recovery told the owner is all it knows
        await wait_for(lambda: _exists(start), "the adoption to start", timeout=60)
        await produce(c.coordinator, "big", extra, start=n)
        async with open_admin(c.coordinator) as a:   # a streamlet on each broker left
            await a.create_stream("small", streamlets=2, replication=3)
        await produce(c.coordinator, "small", 200)
        small = 0
        async with open_consumer(["big", "small"], c.coordinator, start="earliest") as early:
            during = []
            with trio.move_on_after(10):
                while small < 200:   # one pull asks both streams' streamlets: only "big" waits
                    for ch in await early.poll_chunks(0.5):
                        if ch.stream == "big":
                            during.append(ch)
                        else:
                            small += len(ch)
        os.remove(start)
        if fault != "error":
            await wait_for(lambda: _exists(gate), "the adoption to reach the failpoint", timeout=60)
            with open(gate) as f:
                owner = f.read()
            async with open_consumer(["big"], c.coordinator, start="earliest") as early:
                during += await early.poll_chunks(1.0)
            if fault == "new_owner_killed":
                c.kill(next(name for name, addr in c.addrs.items() if addr == owner))
                os.remove(gate)
            else:
                c.kill("coordinator")
                os.remove(gate)
                c.restart("coordinator")
                await _rejoined(c, brokers=2, backups=3)

        async def adopted():
            async with open_admin(c.coordinator) as a:
                st = await a.status()
            return not st["adoptions"] and all(r["state"] != "running" for r in st["recoveries"])

        await wait_for(adopted, "the closed history to be adopted", timeout=90)
        got = await read_all(c.coordinator, ["big"], idle=2.0)
        return rec, during, small, got["big"]

    rec, during, small, arr = trio.run(main)
    assert not rec["lost"] and rec["adopted_segments"] > 0 and rec["deferred_groups"] > 0, rec
    assert not during, "a consumer from earliest read past the pending history"
    assert small == 200, "a stream beside it did not read while the history was pending"
    if fault == "error":
        assert "failpoint adoption.adopted" in c.log("coordinator")
    _check_suffix(arr, n + extra, n * SIZE)
    print(f"\n{fault}: {rec['deferred_groups']} groups adopted after the hand-over, served after "
          f"{rec['serve_seconds']} s; {len(arr)} records read back")


class FrozenHistory:
    """4 nodes, R=3, an 8 MiB budget: stream "big" with 24 MiB of records, half of it evicted,
    so most of its owner's closed vsegs are frozen."""

    budget, history = 8 * MiB, 24 * MiB
    n = history // SIZE

    def __init__(self, make_cluster, backup_args=(), kafka: bool = False):
        self.c = make_cluster(4, broker_args=["--memory", str(self.budget), "--vseg-size", str(1 * MiB)],
                              backup_args=list(backup_args), kafka_port=free_ports(4) if kafka else None)

    async def start(self) -> None:
        c = self.c
        async with open_admin(c.coordinator) as a:
            self.s = await a.create_stream("big", streamlets=1, replication=3, segment_size=256 << 10,
                                           group_segments=32)
        await produce(c.coordinator, "big", self.n, step=2000)
        self.owner = self.s.addrs[0]

        async def settled():
            """The vsegs once eviction is over (memory under the budget's low-water mark, so
            nothing more is evicted) and every frozen vseg is closed: no vseg freezes or
            closes later with copies the test did not count."""
            st = await self.broker("stats")
            vsegs = (await self.broker("vsegs"))["vsegs"]
            return st["evicted_bytes"] >= self.history // 2 and \
                st["memory"] <= LOW_WATER * st["memory_limit"] and \
                all(done for _, _, _, done, _, _, fz in vsegs if fz) and vsegs

        vsegs = await wait_for(settled, "the owner to evict half the history, and settle")
        self.id = (await self.broker("stats"))["broker"]
        # frozen vseg -> the backups holding it, and its (length, checksum) as they list it
        self.frozen = {(v, i): set(copies) for v, i, _, done, copies, _, fz in vsegs if fz}
        self.sums = {(sg["vlog"], sg["vseg"]): (sg["length"], sg["checksum"])
                     for segs in (await backup_listings(c)).values() for sg in segs
                     if sg["broker"] == self.id and sg["closed"]}
        async with open_admin(c.coordinator) as a:
            self.names = {b["id"]: next(k for k, addr in c.addrs.items() if addr == b["addr"])
                          for b in (await a.status())["backups"]}

    async def broker(self, what: str) -> dict:
        async with open_pool() as pool:
            r, _ = await pool.call(self.owner, what, {})
        return r

    async def holders(self, killed: set) -> dict:
        """Frozen vseg -> the live backups listing it closed, at its length and checksum."""
        got: dict = {}
        for bid, segs in (await backup_listings(self.c)).items():
            for sg in segs:
                k = (sg["vlog"], sg["vseg"])
                if bid not in killed and sg["broker"] == self.id and k in self.frozen \
                        and sg["closed"] and (sg["length"], sg["checksum"]) == self.sums[k]:
                    got.setdefault(k, set()).add(bid)
        return got

    def middle_of(self, backup: int) -> tuple[list, tuple[int, int]]:
        """The frozen vsegs ``backup`` holds a copy of, and the middle one."""
        mine = sorted(k for k, cs in self.frozen.items() if backup in cs)
        return mine, mine[len(mine) // 2]

    def file_of(self, backup: int, vseg: tuple[int, int]) -> str:
        """``backup``'s file of frozen ``vseg`` (vlog, vseg)."""
        return os.path.join(self.c.data, self.names[backup], "segments", file_name(self.id, *vseg))

    async def status(self) -> str:
        out = await trio.run_process([sys.executable, "-m", "kera", "status"], capture_stdout=True,
                                     env={**os.environ, "KERA_COORDINATOR": self.c.coordinator})
        return out.stdout.decode()


def _most(vsegs) -> int:
    held = [b for cs in vsegs for b in cs]
    return max(set(held), key=held.count)


def test_frozen_vsegs_get_lost_copies_back_from_a_survivor(make_cluster):
    """Evicted data's vsegs are frozen (their bytes left broker memory): R=3 keeps two backup
    copies of each. kill -9 the backup holding the most of them: each frozen vseg it held is
    copied again, from its surviving copy, to another backup (``kera.broker.rebuild``), as the
    backups' own listings show (closed, same length and checksum). Then kill -9 the backup
    that held the other copy of the most of those: without the rebuild they would have no
    copy left. Every record reads back once, in order, from earliest (most of it from the
    backups), and again after the owner is killed -9 and its streamlet recovered from the
    two backups left."""
    h = FrozenHistory(make_cluster)
    c, n = h.c, h.n

    async def main():
        await h.start()
        first = _most(h.frozen.values())
        second = _most(cs - {first} for cs in h.frozen.values() if first in cs)
        both = [k for k, cs in h.frozen.items() if cs == {first, second}]
        assert both, "no frozen vseg had both its copies on the two backups killed"
        killed: set[int] = set()
        for b in (first, second):
            c.kill(h.names[b])
            killed.add(b)

            async def whole(killed=killed):
                got = await h.holders(killed)
                return all(len(got.get(k, ())) >= 2 for k in h.frozen)

            await wait_for(whole, f"the frozen copies backup {b} held to be made again", timeout=60)
        got = (await read_all(c.coordinator, ["big"], idle=2.0))["big"]
        stats = await h.broker("stats")
        assert f"frozen vsegs: copies made again={stats['rebuild']['rebuilt']} " in await h.status()
        c.kill(next(name for name, addr in c.addrs.items() if addr == h.owner))
        rec = await wait_recovered(c, h.s, timeout=60, dead=h.id)
        again = (await read_all(c.coordinator, ["big"], idle=2.0))["big"]
        return len(h.frozen), len(both), stats, got, rec, again

    vsegs, both, stats, got, rec, again = trio.run(main)
    assert (got == np.arange(n, dtype=np.uint64)).all(), "not every record, once, in order"
    assert stats["tiered_bytes"] > h.history / 2, stats
    assert stats["rebuild"]["rebuilt"] >= 2 * both and stats["rebuild"]["under_replicated"] == 0, stats
    assert not rec["lost"], rec
    assert (again == np.arange(n, dtype=np.uint64)).all(), "not every record after the recovery"
    print(f"\n{vsegs} frozen vsegs, {both} of them on both backups killed; {stats['rebuild']['rebuilt']} "
          f"copies made again ({stats['rebuild']['rebuilt_bytes'] / MiB:.1f} MiB); {len(got)} records read "
          f"back, {stats['tiered_bytes'] / MiB:.1f} MiB of them from backups; after the owner's kill and "
          f"recovery, {len(again)}")


def test_a_whole_copy_the_vlog_does_not_know_of_is_the_source_once_the_known_ones_are_lost(make_cluster):
    """Both known copies of frozen vsegs lost at once, a whole copy of each on a third backup
    that the vlog does not know of (as a copy it gave up on, a slow backup's, whose bytes
    landed after all: here the files of every frozen vseg held by the two backups to be
    killed are put on the third while it is down, then it restarts and lists them). kill -9
    the two: the broker reads the live backups' listings for vsegs with no known copy left,
    takes those copies as sources (``Rebuilder.found``) and makes the second copies from
    them; every frozen vseg is whole on two live backups again and every record reads back
    once, in order. Without it those vsegs stayed on one copy, their records unreadable."""
    h = FrozenHistory(make_cluster)
    c, n = h.c, h.n

    async def main():
        await h.start()
        _, k = h.middle_of(_most(h.frozen.values()))
        assert len(h.frozen[k]) == 2, h.frozen[k]
        a, b = sorted(h.frozen[k])
        pair = [v for v, cs in h.frozen.items() if cs == {a, b}]
        z = min(set(h.names) - {a, b})
        c.kill(h.names[z])
        for v in pair:
            shutil.copyfile(h.file_of(a, v), h.file_of(z, v))
        c.restart(h.names[z])

        async def listed():
            got = await h.holders(set())
            return all(z in got.get(v, ()) for v in pair)

        await wait_for(listed, "the third backup to list the copies put there", timeout=60)
        c.kill(h.names[a])
        c.kill(h.names[b])

        async def whole():
            got = await h.holders({a, b})
            return all(len(got.get(v, ())) >= 2 for v in h.frozen)

        await wait_for(whole, "every frozen vseg whole on two live backups", timeout=90)
        # most of it read back from the backups, two of them just killed: a read that waits
        # on one is no end of the stream
        got = (await read_all(c.coordinator, ["big"], idle=15.0, want=n))["big"]
        return pair, (await h.broker("stats"))["rebuild"], got

    pair, st, got = trio.run(main)
    assert (got == np.arange(n, dtype=np.uint64)).all(), "not every record, once, in order"
    assert st["strays"] >= len(pair) and st["without_copy"] == 0, st
    print(f"\n{len(pair)} frozen vsegs had both known copies killed: {st['strays']} copies the vlog "
          f"did not know of taken as sources, {st['rebuilt']} copies made again; {len(got)} records "
          f"read back")


def test_a_recovery_verifies_the_one_live_copy_it_adopts_from(make_cluster):
    """The backup holding the most frozen copies and the owner are killed -9 at once: the
    frozen vsegs it held are whole on one live backup only, fewer than their chunks were
    acknowledged on, so the recovery's index of each reads that copy's bodies back and
    verifies them before adopting from it (``kera_backup_index_verified_bytes_total``);
    nothing is lost and every record reads back once, in order."""
    h = FrozenHistory(make_cluster)
    c, n = h.c, h.n

    async def main():
        await h.start()
        first = _most(h.frozen.values())
        alone = [k for k, cs in h.frozen.items() if first in cs]
        c.kill(h.names[first])
        c.kill(next(name for name, addr in c.addrs.items() if addr == h.owner))
        rec = await wait_recovered(c, h.s, timeout=90, dead=h.id)
        got = (await read_all(c.coordinator, ["big"], idle=15.0, want=n))["big"]
        async with open_pool() as pool:
            verified = [(await pool.call(c.addrs[name], "stats", {}))[0]["verified_bytes"]
                        for b, name in h.names.items() if b != first]
        return alone, rec, got, verified

    alone, rec, got, verified = trio.run(main)
    assert alone and not rec["lost"], rec
    assert rec["adopted_segments"] > 0, rec
    assert sum(verified) >= len(alone) * MiB // 2, verified   # 1 MiB vsegs, most of each on file
    assert (got == np.arange(n, dtype=np.uint64)).all(), "not every record, once, in order"
    print(f"\n{len(alone)} frozen vsegs left on one live copy; the recovery verified "
          f"{sum(verified) / MiB:.1f} MiB of them, adopted {rec['adopted_segments']} segments; "
          f"{len(got)} records read back")


def test_a_frozen_vseg_is_not_copied_from_a_corrupt_survivor(make_cluster):
    """The surviving copy of a frozen vseg has a chunk rotten on disk when the other copy's
    backup is killed -9: no copy is made of it (the backup's read stops at the bad chunk, a
    new copy is never closed), the vseg is reported short of copies (broker stats, ``kera
    status``), the bad chunk is marked on the survivor, and every other frozen vseg the dead
    backup held is copied again. A reader gets the records before the bad chunk, and every
    record of another stream read in the same pulls; a Kafka Fetch of both is told
    ``KAFKA_STORAGE_ERROR`` for that partition and gets the other's batches."""
    h = FrozenHistory(make_cluster, kafka=True)
    c = h.c

    async def main():
        await h.start()
        dead = _most(h.frozen.values())
        mine, bad = h.middle_of(dead)
        (survivor,) = h.frozen[bad] - {dead}
        flip_middle(h.file_of(survivor, bad))
        c.kill(h.names[dead])

        async def settled():
            st = (await h.broker("stats"))["rebuild"]
            got = await h.holders({dead})
            return st["rebuild_failures"] > 0 and st["under_replicated"] == 1 and all(
                len(got.get(k, ())) >= 2 for k in mine if k != bad) and st

        st = await wait_for(settled, "the other frozen vsegs to be copied again", timeout=60)
        listed = await backup_listings(c)
        copies = [(bid, sg) for bid, segs in listed.items() for sg in segs
                  if sg["broker"] == h.id and (sg["vlog"], sg["vseg"]) == bad]
        # a stream with a streamlet on the same broker, read in the same pulls as "big"
        async with open_admin(c.coordinator) as a:
            small = await a.create_stream("small", streamlets=8, replication=3)
        assert h.owner in small.addrs, small.addrs
        await produce(c.coordinator, "small", 4000, step=4000)
        got = await read_all(c.coordinator, ["big", "small"], idle=3.0)
        # one pull of both from their start, its budget past the rotten chunk
        mine = small.addrs.index(h.owner)
        async with open_pool() as pool:
            one, _ = await pool.call(h.owner, "pull", {"streamlets": [[h.s.id, 0, 0, {}], [small.id, mine, 0, {}]],
                                                       "max_bytes": 32 * MiB})
        node = int(next(name for name, addr in c.addrs.items() if addr == h.owner)[4:].split("-")[0])
        fetched = await trio.to_thread.run_sync(_fetch_both, f"127.0.0.1:{c.kafka_port + node - 1}", mine)
        return st, copies, survivor, await h.status(), got["big"], got["small"], one, small.id, fetched

    st, copies, survivor, status, got, small, one, small_id, fetched = trio.run(main)
    assert all(not sg["closed"] for bid, sg in copies if bid != survivor), copies  # a prefix at most
    assert [sg["corrupt"] for bid, sg in copies if bid == survivor][0], copies
    assert "short of copies=1" in status, status
    # the records before the rotten chunk read back; a pull reaching it refuses that
    # streamlet with a typed error (no copy could be read), never an internal one, and
    # serves the other streamlets it reads ("small"'s on the same broker)
    assert 0 < len(got) < h.n and (got == np.arange(len(got), dtype=np.uint64)).all()
    assert sorted(small.tolist()) == list(range(4000))
    assert one["errors"] == [[h.s.id, 0, "backup"]], one["errors"]
    assert {e[0] for e in one["entries"]} == {small_id} and sum(e[5] for e in one["entries"]) > 0
    assert fetched == {"big": (ErrorCode.kafka_storage_error, 0), "small": (ErrorCode.none, True)}, fetched
    owner = c.log(next(name for name, addr in c.addrs.items() if addr == h.owner))
    assert "reading evicted segment" in owner and "internal error" not in owner
    print(f"\n{st['rebuilt']} copies made again, {st['rebuild_failures']} failed tries of the corrupt one")


def _fetch_both(addr: str, mine: int) -> dict:
    """A Kafka Fetch (v12) of "big" partition 0 and "small" partition ``mine`` from their start,
    at broker ``addr``: per topic (error code, records' bytes or whether there were any)."""
    from kera.kafka import versions

    from .test_kafka import _call, _sock
    req = versions.make(versions.request_class(1, 12), replica_id=-1, max_wait=0, min_bytes=1,
                        max_bytes=32 * MiB, session_epoch=-1, topics=[
                            {"topic": t, "partitions": [{"partition": p, "fetch_offset": 0,
                                                         "partition_max_bytes": 32 * MiB}]}
                            for t, p in (("big", 0), ("small", mine))])
    r = _call(_sock(addr), 1, 12, 1, req)
    out = {}
    for t in r.responses:
        (p,) = t.partitions
        n = len(p.records or b"")
        out[t.topic] = (p.error_code, n if p.error_code != ErrorCode.none else n > 0)
    return out


def test_a_restarted_backup_holding_a_short_frozen_copy_gets_it_made_again(make_cluster):
    """A backup killed -9 comes back with one of its frozen copies cut in half (a torn tail;
    under ``--fsync periodic`` an acknowledged tail may not be on disk yet). The broker asks
    the restarted backup what it reloaded, drops the copy it lists short, and makes it
    again: every frozen vseg is whole again on two live backups (their own listings)."""
    h = FrozenHistory(make_cluster)
    c = h.c

    async def main():
        await h.start()
        x = _most(h.frozen.values())
        _, cut = h.middle_of(x)
        c.kill(h.names[x])
        path = h.file_of(x, cut)
        os.truncate(path, os.path.getsize(path) // 2)
        c.restart(h.names[x])

        async def whole():
            got = await h.holders(set())
            st = (await h.broker("stats"))["rebuild"]   # counted once its close is answered,
            return st["rebuilt"] >= 1 and all(len(got.get(k, ())) >= 2 for k in h.frozen)  # after the listing shows it

        await wait_for(whole, "the short copy to be made again and counted", timeout=60)
        return (await h.broker("stats"))["rebuild"]

    st = trio.run(main)
    assert st["dropped"] >= 1 and st["rebuilt"] >= 1, st
    print(f"\n{st['dropped']} frozen copies no longer counted whole after the restart, {st['rebuilt']} made again")


def test_rot_found_by_scrubbing_gets_the_frozen_copy_made_on_another_backup(make_cluster):
    """A chunk of a frozen copy rots on a live backup's disk, in a file no one reads: the
    backup's scrubber finds it (``kera.backup.scrub``) and its heartbeats say so, the owner
    asks that backup what it holds, no longer counts the damaged copy, and makes the vseg
    again on another backup (not on the damaged one: a resend would be taken as a
    duplicate there). Then kill -9 the backup holding its other intact copy: every record
    still reads back once, in order."""
    h = FrozenHistory(make_cluster, backup_args=["--scrub-rate", str(32 << 20), "--scrub-every", "1"])
    c = h.c

    async def main():
        await h.start()
        x = _most(h.frozen.values())
        _, bad = h.middle_of(x)
        flip_middle(h.file_of(x, bad))

        async def elsewhere():
            got = await h.holders(set())
            return len(got.get(bad, set()) - {x}) >= 2

        await wait_for(elsewhere, "the damaged copy to be made on another backup", timeout=60)
        listed = await backup_listings(c)
        damaged = [sg for sg in listed[x] if sg["broker"] == h.id and (sg["vlog"], sg["vseg"]) == bad]
        (other,) = h.frozen[bad] - {x}
        c.kill(h.names[other])
        got = (await read_all(c.coordinator, ["big"], idle=2.0))["big"]
        async with open_admin(c.coordinator) as a:
            found = {b["id"]: b["damage"] for b in (await a.status())["backups"] if b["alive"]}
        return x, damaged, (await h.broker("stats"))["rebuild"], found, got, await h.status()

    x, damaged, st, found, got, status = trio.run(main)
    assert damaged and damaged[0]["corrupt"], damaged
    assert st["dropped"] >= 1 and st["rebuilt"] >= 1, st
    assert found[x] >= 1 and f"corrupt chunks found={found[x]}" in status, (found, status)
    assert (got == np.arange(h.n, dtype=np.uint64)).all(), "not every record, once, in order"
    print(f"\nthe scrubber found {found[x]} corrupt chunk(s); {st['rebuilt']} copies made again, "
          f"{len(got)} records read back")


async def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _rejoined(c, brokers: int, backups: int) -> None:
    """Wait until that many brokers and backups are alive again for a restarted coordinator."""
    async def back():
        try:
            async with open_admin(c.coordinator) as a:
                st = await a.status()
        except Unavailable:
            return False
        return sum(b["alive"] for b in st["brokers"]) == brokers and sum(b["alive"] for b in st["backups"]) == backups

    await wait_for(back, "the brokers and backups to rejoin the restarted coordinator")


def test_retention_frees_adopted_segments_and_the_dead_brokers_files(make_cluster):
    """After a recovery re-pointed a dead broker's history, the dead broker's vseg files stay
    on the backups only while an owner claims them: once retention freed the adopted
    segments, every file of that broker is deleted (counted in the backups' directories)."""
    budget, history = 8 * MiB, 24 * MiB
    c = _history_cluster(make_cluster, budget)
    n = history // SIZE

    def files_of(broker: int) -> list[str]:
        return [f for f in seg_files(c) if os.path.basename(f).startswith(f"{broker}-")]

    async def main():
        s, rec, dead = await _lose_owner_of_history(c, history, budget)
        kept = len(files_of(dead))
        async with open_admin(c.coordinator) as a:
            d = await a.describe_stream("big")
            owner = next(b for b in (await a.status())["brokers"] if b["addr"] == d.addrs[0])
        async with open_members(c) as pool:  # bad adoptions are refused, typed, and change nothing
            with pytest.raises(ProtocolError):
                await pool.call(owner["addr"], "adopt", {"epoch": owner["epoch"]}, parts=[b"\x00" * 96])
            with pytest.raises(NotOwner):  # a serving streamlet adopts nothing
                await pool.call(owner["addr"], "adopt", {"epoch": owner["epoch"]},
                                parts=[chunk.build(s.id, 0, 1, 0, [b"x" * 8], flags=chunk.INDEX)])
            with pytest.raises(Fenced):  # nor does another incarnation's settle
                await pool.call(owner["addr"], "settle", {"epoch": owner["epoch"] + 1})
            await pool.call(owner["addr"], "settle", {"epoch": owner["epoch"]})  # all settled
        await produce(c.coordinator, "big", n + n // 4, start=n, step=2000)

        async def gone():
            return not files_of(dead)

        await wait_for(gone, "the dead broker's files to be deleted", timeout=60)
        got = await read_all(c.coordinator, ["big"], idle=2.0)
        return rec, kept, got["big"]

    rec, kept, arr = trio.run(main)
    assert rec["adopted_segments"] > 0 and kept > 0, (rec, kept)
    _check_suffix(arr, 2 * n + n // 4, n * SIZE)
    print(f"\n{kept} files of the dead broker kept for {rec['adopted_segments']} adopted segments; "
          f"all deleted once retention freed them")


@pytest.mark.parametrize("coordinator_restart", [False, True])
def test_backup_down_when_a_recovery_ends_lets_go_when_back(make_cluster, coordinator_restart):
    """Broker A's history is re-pointed to B (B claims A's files on every backup); backup X,
    on the third node, is killed -9, then B. Once B's recovery completed (and, in one run, the
    coordinator restarted), X comes back: it deletes every file of B (no live owner claimed
    any on X), releases B's claims, so A's files (dropped when A was recovered) go too, and
    the coordinator's list of recovered incarnations empties. Every retained record reads
    back, from the copies the other backups keep for the new owner."""
    budget, history = 8 * MiB, 24 * MiB
    c = make_cluster(3, broker_args=["--memory", str(budget), "--vseg-size", str(1 * MiB)],
                     port=free_port())
    node_of = {addr: name.split("-")[0] for name, addr in c.addrs.items()}

    async def status():
        try:
            async with open_admin(c.coordinator) as a:
                return await a.status()
        except Unavailable:  # the restarted coordinator waits for its nodes to rejoin
            return None

    async def main():
        s, _, a_id = await _lose_owner_of_history(c, history, budget)
        async with open_admin(c.coordinator) as adm:
            s = await adm.describe_stream("big")
        b_node = node_of[s.addrs[0]]
        b_id = next(b["id"] for b in (await status())["brokers"] if b["addr"] == s.addrs[0])
        x = next(n for n in ("node1", "node2", "node3")   # neither A's node (dead) nor B's
                 if n != b_node and c.procs[f"{n}-broker"].poll() is None)
        x_dir = os.path.join(c.data, f"{x}-backup")

        def files_of(*brokers) -> list[str]:
            return [f for f in seg_files(c) if f.startswith(x_dir + os.sep)
                    and os.path.basename(f).split("-")[0] in {str(b) for b in brokers}]

        async def claimed_on_x() -> int:
            async with open_pool() as pool:
                r, _ = await pool.call(c.addrs[f"{x}-backup"], "stats", {}, timeout=10)
            return r["claimed_files"]

        assert files_of(a_id) and await claimed_on_x() > 0, "B claimed none of A's files on X"
        c.kill(f"{x}-backup")
        c.kill(next(name for name, addr in c.addrs.items() if addr == s.addrs[0]))
        rec = await wait_recovered(c, s, timeout=60)
        held = (len(files_of(a_id)), len(files_of(b_id)))
        assert sum(held), "X held nothing of A or B when it went down"
        if coordinator_restart:
            c.restart("coordinator")

            async def rejoined():
                st = await status()
                return st and sum(b["alive"] for b in st["brokers"]) == 1 \
                    and sum(b["alive"] for b in st["backups"]) == 2
            await wait_for(rejoined, "the nodes to rejoin the restarted coordinator")
        assert (len(files_of(a_id)), len(files_of(b_id))) == held  # nothing deletes them while X is down
        c.restart(f"{x}-backup")
        back = time.monotonic()
        await wait_for(lambda: trio.to_thread.run_sync(lambda: not files_of(a_id, b_id)),
                       "the returned backup to delete the files of A and B", timeout=30)
        held = (*held, time.monotonic() - back)
        assert await claimed_on_x() == 0, "B's claims outlived its recovery on X"

        async def pruned():
            st = await status()
            return st and st["recovered"]["pending"] == 0
        await wait_for(pruned, "every backup to report it let go of the recovered incarnations")
        got = await read_all(c.coordinator, ["big"], idle=2.0)
        return rec, held, got["big"]

    rec, held, arr = trio.run(main)
    assert not rec["lost"], rec
    _check_suffix(arr, history // SIZE, history // SIZE * SIZE)
    print(f"\nbackup down at the end of a re-pointing recovery: {held[0]} files of A and {held[1]} "
          f"of B kept while down, all deleted {held[2]:.2f} s after it was back")
