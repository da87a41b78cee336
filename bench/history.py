"""Recovery time against the evicted history: ``python -m bench.history [--runs 5]``.

The scenario of ``test_retention``'s 4x-history test, repeated: a 3-node
cluster (R=3) whose brokers have an 8 MiB memory budget and 1 MiB vsegs; one
stream (1 streamlet, 256 KiB segments, 32 per group) retaining its whole
history, written until its owner evicted all but its budget; the owner is
killed with -9 and the coordinator's record of the recovery is read once the
new owner serves. Runs alternate 1x (24 MiB) and 4x (96 MiB) histories, in
pairs with the same extra of up to 4 vsegs (4 MiB) drawn at random: what is replayed is
the dead broker's unsettled tail (its vlogs' open vsegs), whose size depends
on where the history ends in them; the extra spreads it over the pairs, and
a pair's two runs differ in their evicted history alone. The kill comes once the ingest's leftovers are
written (``sync``) and the machine is quiet (``bench.stage.quiet``). Reports per history the median time to serve,
the replay's share of it and the rest (planning, re-pointing, adopting,
handing over), the work before the replay (list, plan, index, repoint,
adopt: what grows per vseg of the history), with the bytes replayed and the
segments re-pointed, and the median of the pairs' differences.
Writes bench/results/history.json. ``--shape defaults`` runs the same with
the broker's and stream's default sizes (8 MiB vsegs, 1 MiB segments, 8 per
group) and a 64 MiB budget: 8 times fewer vsegs per GiB of history, and a
replayed tail 8 times longer (history-defaults.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import NamedTuple

import numpy as np
import trio
from kera_client import open_admin, open_producer

from kera.cluster import LocalCluster
from kera.recovery.state import PHASES

from .stage import quiet

MiB = 1 << 20
SIZE = 100


class Shape(NamedTuple):
    budget: int          # the brokers' memory budget (1x history: 3 budgets, 4x: 12)
    vseg: int
    segment: int
    group_segments: int


SHAPES = {"small": Shape(8 * MiB, MiB, 256 << 10, 32), "defaults": Shape(64 * MiB, 8 * MiB, MiB, 8)}
BEFORE_REPLAY = ("list", "plan", "index", "repoint", "adopt")


def _values(start: int, n: int) -> np.ndarray:
    arr = np.full((n, SIZE), ord("x"), dtype=np.uint8)
    arr[:, 0:8] = np.arange(start, start + n, dtype="<u8").view(np.uint8).reshape(n, 8)
    return arr


async def _until(cond, what: str, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while not (r := await cond()):
        if time.monotonic() > deadline:
            raise SystemExit(f"bench history: timed out waiting for {what}")
        await trio.sleep(0.1)
    return r


async def one_run(c: LocalCluster, history: int, shape: Shape = SHAPES["small"]) -> dict:
    """Write ``history`` bytes of records into a fresh stream, kill its owner, return the recovery."""
    n = history // SIZE
    async with open_admin(c.coordinator) as a:
        s = await a.create_stream("big", streamlets=1, replication=3, segment_size=shape.segment,
                                  group_segments=shape.group_segments, retention_bytes=n * SIZE)
    async with open_producer(c.coordinator, **{"linger.ms": 2}) as p:
        for at in range(0, n, 2000):
            await p.send_many("big", _values(at, min(2000, n - at)))
        await p.flush()

    async def held():
        async with open_admin(c.coordinator) as a:
            stats = await a.broker_stats(streams=True)
        mine = [b for b in stats if b["streams"]]
        return mine and mine[0]["evicted_bytes"] >= history - 3 * shape.budget

    await _until(held, "the owner to evict all but its budget", 60)
    # the ingest's leftovers (dirty pages of the backups' files, flushes) are not the recovery's:
    # the kill comes once they are written and the machine is quiet, whatever the history
    await trio.to_thread.run_sync(os.sync)
    settled = await trio.to_thread.run_sync(quiet)
    async with open_admin(c.coordinator) as a:
        victim_id = next(b["id"] for b in (await a.status())["brokers"] if b["addr"] == s.addrs[0])
    c.kill(next(name for name, addr in c.addrs.items() if addr == s.addrs[0]))

    async def recovered():
        async with open_admin(c.coordinator) as a:
            st = await a.status()
            d = await a.describe_stream("big")
        done = [r for r in st["recoveries"] if r["state"] == "done" and r["broker"] == victim_id]
        return done[0] if done and d.addrs[0] not in (None, s.addrs[0]) else None

    return {**await _until(recovered, "the recovery", 60), "quiet": settled}


def summary(runs: list[dict]) -> dict:
    def med(key):
        return round(statistics.median(r[key] for r in runs), 1)
    return {"runs": len(runs), "serve_ms": med("serve_ms"), "replay_ms": med("replay_ms"),
            "rest_ms": med("rest_ms"), "before_replay_ms": med("before_replay_ms"),
            "replayed_mib": med("replayed_mib"),
            "adopted_segments": med("adopted_segments"),
            "serve_ms_all": sorted(r["serve_ms"] for r in runs)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.history")
    ap.add_argument("--runs", type=int, default=5, help="runs per history size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small",
                    help="sizes: small (the default: 8 MiB budget, 1 MiB vsegs, 256 KiB segments, 32 per "
                         "group) or defaults (the broker's and stream's: 8 MiB vsegs, 1 MiB segments, 8 per "
                         "group, with a 64 MiB budget), written to history-defaults.json")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    shape = SHAPES[args.shape]
    out: dict[str, list] = {"1x": [], "4x": []}
    for i in range(args.runs):
        extra = rnd.randrange(0, 4 * shape.vseg, SIZE)
        for name, base in (("1x", 3 * shape.budget), ("4x", 12 * shape.budget)):
            history = base + extra
            with tempfile.TemporaryDirectory(prefix="kera-history-") as d:
                c = LocalCluster(d, 3, broker_args=["--memory", str(shape.budget), "--vseg-size", str(shape.vseg)],
                                 coordinator_args=["--dead-after", "2.0"])
                c.start()
                try:
                    r = trio.run(one_run, c, history, shape)
                finally:
                    c.stop()
            if r["lost"]:
                raise SystemExit(f"bench history: the recovery lost data: {r['lost']}")
            row = {"history_mib": round(history / MiB, 2), "serve_ms": round(r["serve_seconds"] * 1e3, 1),
                   "replay_ms": round(r["replay_seconds"] * 1e3, 1),
                   "rest_ms": round((r["serve_seconds"] - r["replay_seconds"]) * 1e3, 1),
                   "replayed_mib": round(r["bytes"] / MiB, 2), "adopted_segments": r["adopted_segments"],
                   "settle_ms": round(r["settle_seconds"] * 1e3, 1), "quiet": r["quiet"],
                   "phases_ms": {p: round(r[f"{p}_seconds"] * 1e3, 2) for p in PHASES}}
            row["before_replay_ms"] = round(sum(row["phases_ms"][p] for p in BEFORE_REPLAY), 1)
            out[name].append(row)
            print(f"run {i + 1} {name}: {row['history_mib']} MiB history, serving after {row['serve_ms']} ms "
                  f"(replay {row['replay_ms']} ms of {row['replayed_mib']} MiB, the rest {row['rest_ms']} ms), "
                  f"{row['adopted_segments']} segments re-pointed", flush=True)
    result = {"budget_mib": shape.budget // MiB, "shape": shape._asdict(), "summary": {k: summary(v) for k, v in out.items()}, "runs": out}
    one, four = result["summary"]["1x"], result["summary"]["4x"]
    result["ratio_4x_1x"] = {k: round(four[k] / max(one[k], 1e-9), 2)
                             for k in ("serve_ms", "replay_ms", "rest_ms", "before_replay_ms")}
    result["pair_diff_ms"] = {k: round(statistics.median(b[k] - a[k] for a, b in zip(out["1x"], out["4x"], strict=True)), 1)
                              for k in ("serve_ms", "replay_ms", "rest_ms", "before_replay_ms")}
    print(json.dumps({k: result[k] for k in ("summary", "ratio_4x_1x", "pair_diff_ms")}, indent=1))
    os.makedirs(args.out, exist_ok=True)
    name = "history.json" if args.shape == "small" else f"history-{args.shape}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
