"""Benchmarks: kera beside a Kafka-protocol broker (Tansu), after the paper's experiments.

    python -m bench streams [--quick]    # A: streams 1 -> 512, latency config, vs the peer
    python -m bench throughput [--quick] # B: 1 stream x 32 streamlets x 4 groups, chunk and producers
    python -m bench vlogs [--quick]      # C: V = 1 -> 32 shared vlogs, 128 and 512 streams, R=3

Each writes bench/results/<experiment>.json and .png and prints a table. Ratios
compare runs of the same invocation on the same machine, same record size,
linger and chunk/batch size, same number of producer and consumer processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from .kera_side import KeraRun

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _console():
    try:
        from rich.console import Console
        return Console()
    except ImportError:
        return None


def say(msg: str) -> None:
    c = _console()
    (c.print(msg) if c else print(msg, flush=True))


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "when": time.strftime("%Y-%m-%d %H:%M")}


def latency_cfg(chunk: int) -> dict:
    return {"acks": "all", "linger.ms": 1, "chunk.size": chunk}


def exp_streams(args) -> dict:
    counts = [1, 128, 512] if args.quick else [1, 16, 64, 128, 256, 512]
    n = args.records or (100_000 if args.quick else 400_000)
    chunk = 1024
    rows = []
    with KeraRun(args.nodes) as k:
        for s in counts:
            for label, r, vlogs in (("kera R=1", 1, None), ("kera R=3", 3, None),
                                    ("kera R=3 per-group", 3, "per-group")):
                streams = k.create(s, replication=r, vlogs=vlogs)
                say(f"A: {label}, {s} streams, {n} records")
                out = k.measure(streams, n, 100, args.producers, args.consumers, latency_cfg(chunk))
                rows.append({"system": label, "streams": s, **out})
                say(f"   {out}")
    from .peer import run_peer
    for s in counts:
        say(f"A: peer, {s} topics, {n} records")
        out = run_peer(s, n, 100, args.producers, args.consumers, linger_ms=1, batch_size=chunk,
                       count="sampled")
        rows.append({"system": "peer (no replication)", "streams": s, **{k: out.get(k) for k in (
            "produced", "produce_rps", "consumed", "consume_rps", "produce_p50_ms", "produce_p99_ms")}})
        say(f"   {rows[-1]}")
    return {"experiment": "streams", "records": n, "size": 100, "chunk": chunk, "linger_ms": 1,
            "producers": args.producers, "consumers": args.consumers, "nodes": args.nodes, "rows": rows}


def exp_throughput(args) -> dict:
    chunks = [16384] if args.quick else [4096, 16384, 65536]
    producers = [2] if args.quick else [2, 4, 8]
    n = args.records or (200_000 if args.quick else 1_000_000)
    rows = []
    with KeraRun(args.nodes) as k:
        for chunk in chunks:
            for p in producers:
                streams = k.create(1, streamlets=32, groups=4, replication=3)
                for mode in ("send", "batch"):
                    say(f"B: chunk {chunk}, {p} producers, {mode}")
                    out = k.measure(streams, n, 100, p, args.consumers,
                                    {"acks": "all", "linger.ms": 5, "chunk.size": chunk,
                                     "request.size": 4 << 20}, mode=mode)
                    rows.append({"system": f"kera R=3 ({mode})", "chunk": chunk, "producers": p, **out})
                    say(f"   {out}")
    return {"experiment": "throughput", "records": n, "rows": rows, "nodes": args.nodes,
            "consumers": args.consumers}


def exp_vlogs(args) -> dict:
    vs = [1, 4, 32] if args.quick else [1, 2, 4, 8, 16, 32]
    counts = [128] if args.quick else [128, 512]
    n = args.records or (100_000 if args.quick else 400_000)
    rows = []
    for v in vs:
        with KeraRun(args.nodes, broker_args=["--vlogs", str(v)]) as k:
            for s in counts:
                streams = k.create(s, replication=3)
                say(f"C: V={v}, {s} streams")
                out = k.measure(streams, n, 100, args.producers, args.consumers, latency_cfg(1024))
                rows.append({"system": "kera R=3", "vlogs": v, "streams": s, **out})
                say(f"   {out}")
    return {"experiment": "vlogs", "records": n, "rows": rows, "nodes": args.nodes}


def table(res: dict) -> str:
    rows = res["rows"]
    keys = [k for k in ("system", "streams", "vlogs", "chunk", "producers", "produce_rps", "consume_rps",
                        "produce_p50_ms", "produce_p99_ms", "chunks_per_rpc") if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    if res["experiment"] == "streams":
        peer = {r["streams"]: r for r in rows if r["system"].startswith("peer")}
        lines.append("")
        lines.append("| system | streams | produce ratio vs peer | consume ratio vs peer |")
        lines.append("|---|---|---|---|")
        for r in rows:
            p = peer.get(r["streams"])
            if p and not r["system"].startswith("peer") and p.get("produce_rps"):
                cr = (r.get("consume_rps") or 0) / p["consume_rps"] if p.get("consume_rps") else None
                lines.append(f"| {r['system']} | {r['streams']} | {r['produce_rps'] / p['produce_rps']:.2f} | "
                             f"{'' if cr is None else f'{cr:.2f}'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("experiment", choices=["streams", "throughput", "vlogs"])
    ap.add_argument("--quick", action="store_true", help="a smaller run (under ~2 minutes)")
    ap.add_argument("--records", type=int, default=0)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    t0 = time.monotonic()
    res = {"streams": exp_streams, "throughput": exp_throughput, "vlogs": exp_vlogs}[args.experiment](args)
    res["machine"] = machine()
    res["seconds"] = round(time.monotonic() - t0, 1)
    print(table(res))
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{args.experiment}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        from .plot import plot
        plot(res, os.path.join(args.out, f"{args.experiment}.png"))
        print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
