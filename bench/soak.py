"""Soak: ingest many times the brokers' memory budget into streams with retention.

    python -m bench soak [--quick]

A local cluster (3 nodes, R=3) whose brokers have a memory budget (256 MiB),
500 streams whose ``retention.bytes`` add up to ~1 GiB, and one producer that
writes >= 8 GiB of 1000-byte records across them without pausing. Every two
seconds it samples each broker's RSS (from /proc), the segment files on each
backup's disk, and the bytes acknowledged. Then a consumer reads every
stream from earliest (most of it evicted from the brokers, so read back from
the backups). Writes bench/results/soak.json and, when matplotlib is
installed, soak.png (memory and disk over time). ``--quick`` runs a smaller
version (50 streams, 64 MiB budget, 128 MiB retained, 1 GiB ingested) and
writes soak-quick.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import trio

MiB = 1 << 20
GiB = 1 << 30


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except FileNotFoundError:
                pass
    return total


def run(args) -> dict:
    from .kera_side import KeraRun

    budget = args.memory
    per_stream = args.retained // args.streams
    with KeraRun(args.nodes, broker_args=["--memory", str(budget)]) as k:
        c = k.cluster
        brokers = {n: p.pid for n, p in c.procs.items() if n.endswith("-broker")}
        backups = {n: os.path.join(c.data, n) for n in c.procs if n.endswith("-backup")}
        names = [f"soak-{i:04d}" for i in range(args.streams)]
        samples: list[dict] = []
        state = {"acked": 0, "done": False}

        async def create():
            from kera_client import open_admin
            async with open_admin(c.coordinator) as a:
                await a.create_streams(names, streamlets=1, replication=3,
                                       retention_bytes=per_stream)

        async def produce():
            from kera_client import open_producer
            rec = np.full((args.batch, args.size), ord("s"), dtype=np.uint8)
            want = args.ingest // args.size
            async with open_producer(c.coordinator, **{"linger.ms": 5}) as p:
                state["producer"] = p  # the sampler reads its acknowledged count live
                await p.load_metadata(names)
                sent = 0
                while sent < want:
                    for s in names:
                        await p.send_many(s, rec)
                    sent += args.batch * len(names)
                    state["acked"] = p.acked
                await p.flush()
                state["acked"] = p.acked
            state["done"], state["t_end"] = True, time.monotonic()

        async def sample(t0):
            from kera_client import open_admin
            async with open_admin(c.coordinator) as a:
                while True:  # one last sample once every record is acknowledged
                    p = state.get("producer")
                    s = {"t": round(time.monotonic() - t0, 2),
                         "acked_bytes": (p.acked if p is not None else state["acked"]) * args.size,
                         "broker_rss": {n: rss(pid) for n, pid in brokers.items()},
                         "backup_disk": {n: dir_bytes(d) for n, d in backups.items()}}
                    # the brokers' view, to split the disk into what retention keeps, what the
                    # vsegs holding it add, and what backups have not deleted yet
                    st = await a.broker_stats(streams=True)
                    s["retained"] = sum(e["retained"] for b in st for e in b.get("streams", {}).values())
                    s["held_vsegs"] = sum(v.get("held_bytes", 0) for b in st for v in b["vlogs"])
                    samples.append(s)
                    if state["done"]:
                        break
                    await trio.sleep(args.every)

        async def consume():
            from kera_client import open_consumer
            n = 0
            async with open_consumer(names, c.coordinator, start="earliest") as cons:
                quiet = trio.current_time() + 10
                while trio.current_time() < quiet:
                    chunks = await cons.poll_chunks(1.0)
                    if chunks:
                        quiet = trio.current_time() + 10
                    n += sum(len(ch) for ch in chunks)
            return n

        async def stats():
            from kera_client import open_admin
            async with open_admin(c.coordinator) as a:
                return await a.broker_stats(), await a.backup_stats()

        async def main():
            await create()
            t0 = time.monotonic()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample, t0)
                await produce()
            ingest_s = state["t_end"] - t0
            await trio.sleep(3)  # the last reclaim passes
            after_ingest = {"broker_rss": {n: rss(pid) for n, pid in brokers.items()},
                            "backup_disk": {n: dir_bytes(d) for n, d in backups.items()}}
            before = await stats()
            t1 = time.monotonic()
            read = await consume()
            read_s = time.monotonic() - t1 - 10  # minus the quiet wait at the end
            after = await stats()
            return ingest_s, after_ingest, before, read, read_s, after

        ingest_s, after_ingest, before, read, read_s, after = trio.run(main)

    rates = []
    for a, b in zip(samples, samples[1:], strict=False):
        if b["t"] > a["t"]:
            rates.append((b["acked_bytes"] - a["acked_bytes"]) / (b["t"] - a["t"]))
    q = max(1, len(rates) // 4)
    quarters = []
    if len(samples) >= 5:  # acked bytes over each quarter of the ingest time
        t_end = samples[-1]["t"]
        at = [min(samples, key=lambda s, t=t: abs(s["t"] - t)) for t in np.linspace(0, t_end, 5)]
        quarters = [round((b["acked_bytes"] - a["acked_bytes"]) / max(b["t"] - a["t"], 1e-6) / 1e6, 1)
                    for a, b in zip(at, at[1:], strict=False)]
    steady = [s for s in samples if s["t"] >= samples[-1]["t"] / 4] if samples else []
    brokers_after, backups_after = after
    tiered = sum(b["tiered_bytes"] for b in brokers_after) - sum(b["tiered_bytes"] for b in before[0])
    peak_rss = max((max(s["broker_rss"].values()) for s in samples), default=0)
    peak_disk = max((sum(s["backup_disk"].values()) for s in samples), default=0)
    acked = samples[-1]["acked_bytes"] if samples else 0
    return {
        "experiment": "soak", "quick": args.quick,
        "config": {"nodes": args.nodes, "replication": 3, "broker_budget": budget,
                   "streams": args.streams, "retention_bytes_per_stream": per_stream,
                   "retained_total": per_stream * args.streams, "record_size": args.size,
                   "ingest_target": args.ingest},
        "summary": {
            "ingested_bytes": int(ingest_s and sum(b["bytes"] for b in brokers_after)),
            "ingest_seconds": round(ingest_s, 1),
            "ingest_mb_s": round(sum(b["bytes"] for b in brokers_after) / ingest_s / 1e6, 1),
            "rate_first_quarter_mb_s": round(float(np.mean(rates[:q])) / 1e6, 1) if rates else None,
            "rate_last_quarter_mb_s": round(float(np.mean(rates[-q:])) / 1e6, 1) if rates else None,
            "rate_stdev_mb_s": round(float(np.std(rates)) / 1e6, 1) if rates else None,
            "rate_per_quarter_mb_s": quarters,
            # after the first quarter (retention has started freeing): the disk, split
            "steady_retained_mib": round(float(np.mean([s["retained"] for s in steady])) / MiB, 1) if steady else None,
            "steady_held_vsegs_mib": round(float(np.mean([s["held_vsegs"] for s in steady])) / MiB, 1) if steady else None,
            "steady_backup_disk_mib": round(float(np.mean([sum(s["backup_disk"].values()) for s in steady])) / MiB, 1) if steady else None,
            "peak_broker_rss_mib": round(peak_rss / MiB, 1),
            "peak_backup_disk_mib": round(peak_disk / MiB, 1),
            "after_ingest_broker_rss_mib": {n: round(v / MiB, 1) for n, v in after_ingest["broker_rss"].items()},
            "after_ingest_backup_disk_mib": {n: round(v / MiB, 1) for n, v in after_ingest["backup_disk"].items()},
            "evictions": sum(b["evictions"] for b in brokers_after),
            "evicted_mib": round(sum(b["evicted_bytes"] for b in brokers_after) / MiB, 1),
            "reclaimed_on_backups_mib": round(sum(b.get("reclaimed_bytes", 0) for b in backups_after) / MiB, 1),
            "read_from_earliest_records": read,
            "read_seconds": round(read_s, 1),
            "read_mb_s": round(read * args.size / max(read_s, 1e-6) / 1e6, 1),
            "read_from_backups_mib": round(tiered / MiB, 1),
        },
        "samples": [{"t": s["t"], "acked_mib": round(s["acked_bytes"] / MiB, 1),
                     "max_broker_rss_mib": round(max(s["broker_rss"].values()) / MiB, 1),
                     "backup_disk_mib": round(sum(s["backup_disk"].values()) / MiB, 1),
                     "retained_mib": round(s["retained"] / MiB, 1),
                     "held_vsegs_mib": round(s["held_vsegs"] / MiB, 1)}
                    for s in samples],
        "acked_bytes_sampled": acked,
    }


def plot(res: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["samples"]
    t = [x["t"] for x in s]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(t, [x["max_broker_rss_mib"] for x in s], label="largest broker RSS (MiB)")
    ax.plot(t, [x["backup_disk_mib"] for x in s], label="backup files, all backups (MiB)")
    if s and "held_vsegs_mib" in s[0]:
        ax.plot(t, [x["held_vsegs_mib"] for x in s], label="vsegs brokers hold (one copy, MiB)")
        ax.plot(t, [x["retained_mib"] for x in s], label="retained by brokers (MiB)")
    ax.axhline(res["config"]["retained_total"] / MiB, linestyle=":", color="grey",
               label="retention.bytes, all streams")
    ax.axhline(res["config"]["broker_budget"] / MiB, linestyle="--", color="grey", label="broker budget")
    ax2 = ax.twinx()
    ax2.plot(t, [x["acked_mib"] / 1024 for x in s], color="black", linestyle=":", label="ingested (GiB)")
    ax2.set_ylabel("GiB ingested")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title("soak: memory and disk while ingesting past retention")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench soak")
    ap.add_argument("--quick", action="store_true", help="50 streams, 64 MiB budget, 1 GiB ingested")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    args.size, args.every = 1000, 1.0
    if args.quick:
        args.streams, args.memory, args.retained, args.ingest, args.batch = 50, 64 * MiB, 128 * MiB, GiB, 200
    else:
        args.streams, args.memory, args.retained, args.ingest, args.batch = 500, 256 * MiB, GiB, 8 * GiB, 40
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    name = "soak-quick" if args.quick else "soak"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    drew = plot(res, os.path.join(args.out, f"{name}.png"))
    print(json.dumps(res["summary"], indent=1))
    print(f"wrote {name}.json" + (f" and {name}.png" if drew else " (no PNG: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
