"""Metadata figures: how fast the coordinator creates streams, and whether a cheap
request (standing in for a heartbeat) waits behind the metadata writes meanwhile.

    python -m bench.metadata [--streams 2000] [--nodes 1] [--replication 1] [--concurrency 32] [--batch]

Streams of one streamlet are created through the admin client, ``--concurrency``
at a time, or with ``--batch`` by ``create_streams`` (MAX_BATCH_STREAMS a request);
a probe asks the coordinator a one-name ``metadata`` question every 20 ms and the
slowest answer is reported. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import trio
from kera_client import open_admin

from kera.rpc import open_pool

from .kera_side import KeraRun


async def run(k: KeraRun, streams: int, replication: int, concurrency: int, batch: bool = False) -> dict:
    coord = k.cluster.coordinator
    names = [f"m{i:06d}" for i in range(streams)]
    limit = trio.CapacityLimiter(concurrency)
    probes: list[float] = []

    async def probe(pool, done: trio.Event):
        while not done.is_set():
            t = time.monotonic()
            await pool.call(coord, "metadata", {"names": ["m000000"]}, timeout=30)
            probes.append(time.monotonic() - t)
            with trio.move_on_after(0.02):
                await done.wait()

    async with open_admin(coord) as a, open_pool() as pool:
        async def one(n):
            async with limit:
                await a.create_stream(n, streamlets=1, replication=replication)

        done = trio.Event()
        async with trio.open_nursery() as outer:
            outer.start_soon(probe, pool, done)
            t0 = time.monotonic()
            if batch:
                await a.create_streams(names, streamlets=1, replication=replication)
            else:
                async with trio.open_nursery() as n:
                    for name in names:
                        n.start_soon(one, name)
            seconds = time.monotonic() - t0
            done.set()
        listed = len(await a.list_streams())
    probes.sort()
    return {"streams": streams, "listed": listed, "replication": replication,
            "concurrency": None if batch else concurrency, "batch": batch, "seconds": round(seconds, 2),
            "streams_per_s": round(streams / seconds, 1),
            "probe_p50_ms": round(1000 * probes[len(probes) // 2], 2),
            "probe_max_ms": round(1000 * probes[-1], 2), "probes": len(probes)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.metadata")
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--replication", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batch", action="store_true", help="create_streams instead of one request each")
    args = ap.parse_args()
    with KeraRun(args.nodes) as k:
        res = trio.run(run, k, args.streams, args.replication, args.concurrency, args.batch)
    res["nodes"] = args.nodes
    print(json.dumps(res))


if __name__ == "__main__":
    main()
