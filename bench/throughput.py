"""Issue 12's throughput configuration: records/s acknowledged with R=3 while a consumer reads them.

    python -m bench throughput [--quick] [--repeats 3]

One stream of 32 streamlets in 4 groups, R=3, 3 nodes, 100-byte records; two
producer processes and one consumer process run at once (the consumer reads
from the stream's start while the producers write, counting records from
chunk headers). Each configuration is labelled by the producer API it uses:

- ``send_columns``: the batch API (numpy columns, chunks packed whole, no
  per-record Python), large chunks;
- ``send``: one ``send()`` per record from Python, the default-sized chunks.

Configurations alternate within each repeat; every run has a fresh stream.
Reported per configuration: median, min and max over the repeats of records/s
acknowledged (first producer start -> last acknowledgement) and consumed, the
CPU seconds each kind of process used per record (producers and consumer from
their own rusage, servers from /proc), and the load average around each run
(the machine is shared; CPU per record holds under load, rates do not).
"""

from __future__ import annotations

import os
import statistics

from .kera_side import KeraRun

STREAMLETS, GROUPS, SIZE = 32, 4, 100
CONFIGS = {
    "send_columns": {"mode": "send_columns", "producers": 2,
                     "cfg": {"acks": "all", "linger.ms": 5, "chunk.size": 262144, "request.size": 4 << 20}},
    "send": {"mode": "send", "producers": 2,
             "cfg": {"acks": "all", "linger.ms": 5, "chunk.size": 16384, "request.size": 4 << 20}},
}


def spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs)), "min": round(min(xs)), "max": round(max(xs))}


def run(args, say) -> dict:
    n = args.records or (400_000 if args.quick else 4_000_000)
    repeats = 1 if args.quick else max(3, args.repeats)
    rows = []
    with KeraRun(args.nodes) as k:
        for r in range(repeats):
            order = list(CONFIGS)
            order = order[r % len(order):] + order[:r % len(order)]
            for name in order:
                c = CONFIGS[name]
                streams = k.create(1, streamlets=STREAMLETS, groups=GROUPS, replication=3)
                load0 = os.getloadavg()[0]
                out = k.measure(streams, n, SIZE, c["producers"], 1, c["cfg"], mode=c["mode"])
                k.delete(streams)
                row = {"system": f"kera R=3 ({name})", "api": name, "repeat": r + 1,
                       "chunk": c["cfg"]["chunk.size"], "producers": c["producers"], "consumers": 1,
                       **out, "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}
                rows.append(row)
                say(f"throughput {name}, run {r + 1}: {row['produce_rps']:,} acked/s, "
                    f"{row['consume_rps']:,} consumed/s, CPU us/record {row['cpu_us_per_record']}, "
                    f"load {row['load']}")
    summary = []
    for name, c in CONFIGS.items():
        mine = [x for x in rows if x["api"] == name]
        kinds = mine[0]["cpu_us_per_record"]
        summary.append({"system": f"kera R=3 ({name})", "api": name, "producers": c["producers"],
                        "chunk": c["cfg"]["chunk.size"], "runs": len(mine),
                        "produce_rps": spread([x["produce_rps"] for x in mine]),
                        "consume_rps": spread([x["consume_rps"] for x in mine]),
                        "cpu_us_per_record": {q: round(statistics.median(x["cpu_us_per_record"][q] for x in mine), 2)
                                              for q in kinds},
                        "load": [min(x["load"][0] for x in mine), max(x["load"][1] for x in mine)]})
    return {"experiment": "throughput", "records": n, "size": SIZE, "streamlets": STREAMLETS, "groups": GROUPS,
            "replication": 3, "nodes": args.nodes, "configs": CONFIGS, "summary": summary, "rows": rows}


def table(res: dict) -> str:
    lines = ["| API | producers | chunk | acked rec/s median (min-max) | consumed rec/s median (min-max) "
             "| CPU us/record: prod, cons, brokers, backups, coord | load |", "|---|---|---|---|---|---|---|"]
    for s in res["summary"]:
        p, c, u = s["produce_rps"], s["consume_rps"], s["cpu_us_per_record"]
        lines.append(f"| {s['api']} | {s['producers']} | {s['chunk']} | {p['median']:,} ({p['min']:,}-{p['max']:,}) "
                     f"| {c['median']:,} ({c['min']:,}-{c['max']:,}) | {u['producers']}, {u['consumers']}, "
                     f"{u['brokers']}, {u['backups']}, {u['coordinators']} | {s['load'][0]}-{s['load'][1]} |")
    return "\n".join(lines)
