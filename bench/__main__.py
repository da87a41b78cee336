"""Benchmarks: kera beside a Kafka-protocol broker (Tansu), after the paper's experiments.

    python -m bench streams [--quick] [--counts 1,512,2048,10000,100000]
                                         # the headline: 1 -> 100,000 streams like for like beside the peer,
                                         # 3 runs each, with its targets checked (bench/streams.py);
                                         # --auth --tls: also R=3 in those modes (target >= 0.9x at 512)
    python -m bench throughput [--quick] # 1 stream x 32 streamlets x 4 groups, R=3, 2 producers and a
                                         # consumer at once: send_columns beside send() (bench/throughput.py)
    python -m bench vlogs [--quick]      # C: V = 1 -> 32 shared vlogs, 128 and 512 streams, R=3
    python -m bench latency [--quick]    # p50/p99 ack latency vs offered load, fractions of kera R=3's
                                         # maximum, target checked at half of it (bench/latency.py)
    python -m bench metadata [--quick]   # 100k streams: create rate, RSS per stream, fan-out (bench/metadata.py)
    python -m bench many [--quick]       # 10k, 100k, 1M streams of one record each: produce, consume by
                                         # pattern, memory per stream, targets checked (bench/many.py)
    python -m bench restart [--quick]    # kill -9 of a whole cluster of 1M streams, 100k holding data:
                                         # time to serving again, every record read back (bench/restart.py)
    python -m bench soak [--quick]       # retention: ingest 8 GiB past a 256 MiB broker budget
    python -m bench kafka [--quick]      # one librdkafka producer then consumer: kera's Kafka listener
                                         # (R=1, R=3) beside the peer at 1 -> 2,048 topics (bench/kafka.py)
    python -m bench hops [--label L]     # CPU us per 1-record chunk and per 1-chunk request on each hop (bench/hops.py)

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


def exp_latency(args) -> dict:
    from .latency import run
    return run(args, say)


def exp_throughput(args) -> dict:
    from .throughput import run
    return run(args, say)


def exp_vlogs(args) -> dict:
    """C: V = 1 -> 32 at R=3; at V = 1, 4, 32 also R = 1, 2 and chunks of 16 KB."""
    vs = [1, 4, 32] if args.quick else [1, 2, 4, 8, 16, 32]
    counts = [128] if args.quick else [128, 512]
    n = args.records or (100_000 if args.quick else 200_000)
    rows = []
    for v in vs:
        full = not args.quick and v in (1, 4, 32)
        with KeraRun(args.nodes, broker_args=["--vlogs", str(v)]) as k:
            for s in counts:
                for r in ((1, 2, 3) if full else (3,)):
                    for chunk in ((1024, 16384) if full else (1024,)):
                        streams = k.create(s, replication=r)
                        say(f"C: V={v}, {s} streams, R={r}, chunk {chunk}")
                        out = k.measure(streams, n, 100, args.producers, args.consumers, latency_cfg(chunk))
                        rows.append({"system": f"kera R={r}", "vlogs": v, "streams": s, "chunk": chunk, **out})
                        say(f"   {out}")
    return {"experiment": "vlogs", "records": n, "rows": rows, "nodes": args.nodes}


def exp_streams(args) -> dict:
    from .streams import COUNTS, QUICK_COUNTS, QUICK_SECONDS, SECONDS, run
    n = args.records or (50_000 if args.quick else 300_000)   # the concurrent phase's records
    seconds = args.seconds or (QUICK_SECONDS if args.quick else SECONDS)
    if args.metrics:
        from .streams import metrics_cost
        return metrics_cost(n, seconds, args.repeats, say)
    counts = [int(x) for x in args.counts.split(",")] if args.counts else \
        (QUICK_COUNTS if args.quick else COUNTS)
    return run(counts, n, seconds, args.repeats, args.concurrent, say, auth=args.auth, tls=args.tls)


def exp_metadata(args) -> dict:
    from .metadata import run
    return run(args, say)


def exp_many(args) -> dict:
    from .many import run
    return run(args, say)


def exp_restart(args) -> dict:
    from .restart import run
    return run(args, say)


def table(res: dict) -> str:
    if res["experiment"] == "streams-metrics":
        from .streams import metrics_table
        return metrics_table(res)
    if res["experiment"] == "streams":
        from .streams import table as streams_table
        return streams_table(res)
    if res["experiment"] == "many":
        from .many import table as many_table
        return many_table(res)
    if res["experiment"] == "restart":
        return "\n".join(f"{k}: {v}" for k, v in res["rows"][0].items())
    if res["experiment"] == "throughput":
        from .throughput import table as throughput_table
        return throughput_table(res)
    if res["experiment"] == "latency":
        a = res["acceptance"]
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[a["pass"]]
        tail = (f"\n\nkera R=3 maximum at {res['streams']} streams: {res['max_rps']:,} records/s; at half "
                f"({a['offered']:,}/s) kera R=3 p99 {a['kera_r3_p99_ms']} ms (target <= {a['bound_ms']:g} ms: "
                f"{verdict}), peer p99 {a['peer_p99_ms']} ms")
        return _rows_table(res["rows"]) + tail
    return _rows_table(res["rows"])


def _rows_table(rows: list[dict]) -> str:
    keys = [k for k in ("system", "streams", "vlogs", "chunk", "producers", "rate", "offered", "produce_rps",
                        "consume_rps", "produce_p50_ms", "produce_p99_ms", "produce_p999_ms", "chunks_per_rpc",
                        *sorted({k for r in rows for k in r if k.startswith("create_per_s@")},
                                key=lambda k: int(k.split("@")[1])),
                        "create_rate_vs_peer", "rss_kib_per_stream", "probe_max_ms", "fanout_streams",
                        "fanout_s", "consume_s") if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    import sys
    if sys.argv[1:2] == ["soak"]:  # its own options (bench/soak.py)
        from .soak import main as soak
        soak(sys.argv[2:])
        return
    if sys.argv[1:2] == ["kafka"]:  # its own options (bench/kafka.py)
        from .kafka import main as kafka
        kafka(sys.argv[2:])
        return
    if sys.argv[1:2] == ["hops"]:  # its own options (bench/hops.py)
        from .hops import main as hops
        hops(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("experiment", choices=["streams", "throughput", "vlogs", "latency", "metadata", "many",
                                             "restart", "soak"])
    ap.add_argument("--repeats", type=int, default=3, help="streams, throughput: runs per cell, systems alternating")
    ap.add_argument("--concurrent", action="store_true", help="streams: also producer and consumer at once")
    ap.add_argument("--metrics", action="store_true",
                    help="streams: kera R=3 at 512 streams with every server's metrics scraped each "
                         "second against without, paired runs (what metrics cost)")
    ap.add_argument("--quick", action="store_true", help="a smaller run (under ~2 minutes)")
    ap.add_argument("--records", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=0.0, help="streams: length of each producer phase alone")
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--counts", default="", help="streams, many: stream counts; restart: streams and those with data; comma-separated")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--auth", action="store_true",
                    help="streams: also a cluster with user authentication and ACLs (an admin client)")
    ap.add_argument("--tls", action="store_true", help="streams: also a cluster with TLS everywhere")
    args = ap.parse_args()
    t0 = time.monotonic()
    res = {"streams": exp_streams, "throughput": exp_throughput, "vlogs": exp_vlogs,
           "latency": exp_latency, "metadata": exp_metadata, "many": exp_many,
           "restart": exp_restart}[args.experiment](args)
    res["machine"] = machine()
    res["seconds"] = round(time.monotonic() - t0, 1)
    print(table(res))
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{res['experiment']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        if res["experiment"] == "restart":   # one row: its table says it all
            print(f"wrote {path}")
            return
        from .plot import plot
        plot(res, os.path.join(args.out, f"{res['experiment']}.png"))
        print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
