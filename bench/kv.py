"""Key-value map figures: operations per second and latency of puts and linearizable gets.

    python -m bench.kv [--nodes 3] [--clients 8] [--seconds 10] [--keys 100]

``--clients`` map clients (each its own connection and producer id, in one process)
run put-only, then get-only, then a 50/50 mix of get and compare_and_set, on a map
stream with R=min(3, nodes). Prints one JSON object: per phase ops/s, p50/p99 in ms.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import trio
from kera_client.kv import open_kv

from .kera_side import KeraRun


async def phase(maps, kind: str, seconds: float, keys: int) -> dict:
    lat: list[float] = []

    async def client(m, seed):
        rnd = random.Random(seed)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            k = f"k{rnd.randrange(keys)}"
            op = kind if kind != "mix" else rnd.choice(("get", "cas"))
            t = time.monotonic()
            if op == "put":
                await m.put(k, b"v" * 100)
            elif op == "get":
                await m.get(k)
            else:
                cur = await m.get_versioned(k)
                await m.compare_and_set(k, cur[0] if cur else 0, b"w" * 100)
            lat.append(time.monotonic() - t)

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        for i, m in enumerate(maps):
            n.start_soon(client, m, i)
    dt = time.monotonic() - t0
    a = np.array(lat) * 1000
    return {"ops": len(lat), "ops_per_s": round(len(lat) / dt), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2)}


async def run(coord: str, clients: int, seconds: float, keys: int) -> dict:
    out = {}
    async with trio.open_nursery() as n:
        maps = []

        async def opener(task_status=trio.TASK_STATUS_IGNORED):
            async with open_kv("bench-kv", coord) as m:
                task_status.started(m)
                await trio.sleep_forever()

        for _ in range(clients):
            maps.append(await n.start(opener))
        for kind in ("put", "get", "mix"):
            out[kind] = await phase(maps, kind, seconds, keys)
        n.cancel_scope.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kv")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--keys", type=int, default=100)
    args = ap.parse_args()
    with KeraRun(args.nodes) as k:
        res = trio.run(run, k.cluster.coordinator, args.clients, args.seconds, args.keys)
    print(json.dumps({"nodes": args.nodes, "clients": args.clients, **res}))


if __name__ == "__main__":
    main()
