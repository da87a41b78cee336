"""Consumer-group commit figures: commits per second and latency through the positions stream.

    python -m bench.group_positions [--nodes 3] [--consumers 1,100] [--seconds 10]

For each count in ``--consumers``: that many group consumers (one process, one shared
``GroupPositions``, one group each) of a one-streamlet stream commit back to back for
``--seconds``; then one fetch of a group's positions, reading its whole streamlet
(no compaction here: every commit of the run is still in it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import trio
from kera_client import AsyncConsumer, open_admin
from kera_client.positions import GroupPositions

from kera.rpc import open_pool

from .kera_side import KeraRun


def _ms(xs) -> dict:
    a = np.array(xs) * 1000
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p99_ms": round(float(np.percentile(a, 99)), 2)}


async def phase(coord: str, consumers: int, seconds: float) -> dict:
    lat: list[float] = []
    async with open_pool() as pool:
        shared = GroupPositions(pool, coord)

        async def one(k: int):
            c = AsyncConsumer(pool, coord, ["bench-groups"], group=f"bench-{consumers}-{k}", positions=shared)
            await c._metadata()
            await c.commit()
            end, n = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                n += 1
                c.positions[("bench-groups", 0)] = {"low": 0, "groups": {0: n}}
                t = time.monotonic()
                await c.commit()
                lat.append(time.monotonic() - t)

        async with trio.open_nursery() as n:
            for k in range(consumers):
                n.start_soon(one, k)
        reader = GroupPositions(pool, coord)   # a fresh process's view: reads the whole streamlet
        t = time.monotonic()
        await reader.fetch(f"bench-{consumers}-0")
        fetch = time.monotonic() - t
    return {"commits": len(lat), "commits_per_s": round(len(lat) / seconds), **_ms(lat),
            "first_fetch_ms": round(fetch * 1000, 1)}


async def run(coord: str, counts: list[int], seconds: float) -> dict:
    async with open_admin(coord) as a:
        await a.create_stream("bench-groups", streamlets=1)
    return {str(c): await phase(coord, c, seconds) for c in counts}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.group_positions")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--consumers", default="1,100")
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    counts = [int(x) for x in args.consumers.split(",")]
    with KeraRun(args.nodes) as k:
        res = trio.run(run, k.cluster.coordinator, counts, args.seconds)
    print(json.dumps({"nodes": args.nodes, "consumers": res}))


if __name__ == "__main__":
    main()
