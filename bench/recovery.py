"""Recovery figures: kill -9 a broker holding ~N MB of acknowledged data, time
its replay from the backups into the live brokers.

    python -m bench.recovery [--mb 100] [--nodes 4]

Reports recovery time and replay rate (from the coordinator's recovery
record), how many backups replayed in parallel, and how long a producer that
keeps writing through the crash was blocked (the longest gap between acks).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import trio
from kera_client import open_admin, open_producer

from kera.rpc import open_pool

from .kera_side import KeraRun


async def broker_bytes(addr: str) -> int:
    async with open_pool() as pool:
        r, _ = await pool.call(addr, "stats", {}, timeout=10)
        return r["bytes"]


async def run(k: KeraRun, mb: int, streams: int) -> dict:
    c = k.cluster
    coord = c.coordinator
    names = await k.acreate(streams, replication=3)
    victim = "node2-broker"
    vaddr = c.addrs[victim]
    arr = np.full((1000, 100), ord("x"), dtype=np.uint8)
    # fill until the victim holds ~mb MB of acknowledged data
    async with open_producer(coord, **{"chunk.size": 65536, "linger.ms": 5}) as p:
        await p.load_metadata(names)
        while await broker_bytes(vaddr) < mb * 1_000_000:
            for s in names:
                await p.send_many(s, arr)
            await p.flush()
    held = await broker_bytes(vaddr)
    gaps = []
    out = {}
    async with open_producer(coord, **{"linger.ms": 1, "chunk.size": 4096}) as p:
        await p.load_metadata(names)
        stop = trio.Event()

        async def keep_writing():
            last, acked = time.monotonic(), p.acked
            i = 0
            while not stop.is_set():
                await p.send(names[i % len(names)], b"y" * 100)
                i += 1
                if i % 200 == 0:
                    await trio.sleep(0)
                    if p.acked != acked:
                        now = time.monotonic()
                        gaps.append(now - last)
                        last, acked = now, p.acked

        async with trio.open_nursery() as n:
            n.start_soon(keep_writing)
            await trio.sleep(1)
            t_kill = time.monotonic()
            c.kill(victim)
            async with open_admin(coord) as a:
                while True:
                    recs = [r for r in (await a.status())["recoveries"] if r["state"] == "done"]
                    if recs:
                        break
                    await trio.sleep(0.1)
            out["until_recovered_s"] = round(time.monotonic() - t_kill, 2)
            await trio.sleep(1)
            stop.set()
    rec = recs[-1]
    out.update(victim_bytes=held, replayed_bytes=rec["bytes"], replayed_chunks=rec["chunks"],
               recovery_s=rec["seconds"], replay_mb_s=rec["rate_mb_s"], backups_in_parallel=rec["backups"],
               vlogs=rec["vlogs"], streamlets=rec["streamlets"],
               producer_blocked_s=round(max(gaps), 2) if gaps else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.recovery")
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    with KeraRun(args.nodes) as k:
        res = trio.run(run, k, args.mb, args.streams)
    res.update(nodes=args.nodes, streams=args.streams, dead_after_s=2.0)
    print(json.dumps(res, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "recovery.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
