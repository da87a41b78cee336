"""kera beside the peer, like for like: ``python -m bench compare [--quick] [--concurrent]``.

Every cell is the same on both sides: 100-byte records; one producer process
calling send() / produce() once per record, records round-robin over the
streams (topics of one partition); acks=all; linger 5 ms; chunk.size =
batch.size = 16 KB; then one consumer process reading them all and touching
every record's value (``len`` of its bytes) on both sides. Rows:

- ``peer``: Tansu, in memory, no replication, no disk;
- ``kera R=1``: no replication across processes (one disk copy on a backup):
  the pair to hold against the peer;
- ``kera R=3``: with replication (3 nodes), work the peer does not do.

kera's chunk-level reading (records counted from chunk headers, values not
touched) is reported in a column of its own. Each cell runs ``--repeats``
times (3) with the systems in a rotating order; the median and the range
(min-max) are reported, every run is in the results file. kera uses one
3-node cluster whose streams are deleted after each run; the peer gets a
fresh broker per run. Phases: producer alone, then consumer alone;
``--concurrent`` adds runs with both at once. Writes
bench/results/compare[-quick].json and .png.
"""

from __future__ import annotations

import statistics

from .kera_side import KeraRun

SIZE = 100
CFG = {"acks": "all", "linger.ms": 5, "chunk.size": 16384}
SYSTEMS = ("peer", "kera R=1", "kera R=3")


def _run_kera(k: KeraRun, r: int, streams: int, n: int, concurrent: bool) -> dict:
    names = k.create(streams, replication=r)
    try:
        out = k.measure(names, n, SIZE, 1, 1, CFG, sequential=not concurrent, touch=True,
                        chunk_read=not concurrent)
    finally:
        k.delete(names)
    return out


def _run_peer(streams: int, n: int, concurrent: bool) -> dict:
    from .peer import run_peer
    out = run_peer(streams, n, SIZE, 1, 1, linger_ms=CFG["linger.ms"], batch_size=CFG["chunk.size"],
                   count="sampled", sequential=not concurrent, touch=True)
    return {key: out.get(key) for key in ("produced", "produce_rps", "consumed", "consume_rps",
                                          "produce_p50_ms", "produce_p99_ms", "create_topics_s")}


def _stat(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values)), "min": round(min(values)), "max": round(max(values)),
            "runs": len(values)}


def run(counts: list[int], n: int, repeats: int, concurrent: bool, say) -> dict:
    runs: list[dict] = []
    phases = ["sequential"] + (["concurrent"] if concurrent else [])
    with KeraRun(3) as k:
        for rep in range(repeats):
            for s in counts:
                for phase in phases:
                    order = SYSTEMS[rep % 3:] + SYSTEMS[:rep % 3]   # rotate who goes first
                    for system in order:
                        say(f"compare: repeat {rep + 1}/{repeats}, {s} streams, {phase}, {system}")
                        conc = phase == "concurrent"
                        out = _run_peer(s, n, conc) if system == "peer" else \
                            _run_kera(k, int(system[-1]), s, n, conc)
                        runs.append({"system": system, "streams": s, "phase": phase, "repeat": rep, **out})
                        say(f"   produce {out['produce_rps']:,}/s, consume {out.get('consume_rps') or 0:,}/s")
    cells = []
    for phase in phases:
        for s in counts:
            for system in SYSTEMS:
                mine = [r for r in runs if (r["system"], r["streams"], r["phase"]) == (system, s, phase)]
                cells.append({"system": system, "streams": s, "phase": phase,
                              "produce_rps": _stat([r["produce_rps"] for r in mine]),
                              "consume_rps": _stat([r.get("consume_rps") for r in mine]),
                              "consume_rps_chunks": _stat([r.get("consume_rps_chunks") for r in mine]),
                              "produce_p99_ms": _stat([r.get("produce_p99_ms") for r in mine])})
    return {"experiment": "compare", "records": n, "size": SIZE, "config": CFG, "repeats": repeats,
            "producers": 1, "consumers": 1, "cells": cells, "runs": runs}


def table(res: dict) -> str:
    def fmt(st):
        if not st:
            return ""
        return f"{st['median'] / 1000:.0f}k ({st['min'] / 1000:.0f}-{st['max'] / 1000:.0f}k)"

    lines = []
    for phase in sorted({c["phase"] for c in res["cells"]}, reverse=True):
        what = "producer alone, then consumer alone" if phase == "sequential" else "producer and consumer at once"
        lines += [f"{what}: records/s, median (min-max) of {res['repeats']} runs", "",
                  "| streams | peer produce | kera R=1 produce | kera R=3 produce | R=1 / peer | "
                  "peer consume | kera R=1 consume | kera R=3 consume | kera R=3 consume, chunk-level |",
                  "|---|---|---|---|---|---|---|---|---|"]
        by = {(c["system"], c["streams"]): c for c in res["cells"] if c["phase"] == phase}
        for s in sorted({c["streams"] for c in res["cells"]}):
            peer, k1, k3 = by[("peer", s)], by[("kera R=1", s)], by[("kera R=3", s)]
            ratio = (k1["produce_rps"]["median"] / peer["produce_rps"]["median"]
                     if peer["produce_rps"] and k1["produce_rps"] else 0)
            lines.append(f"| {s} | {fmt(peer['produce_rps'])} | {fmt(k1['produce_rps'])} | "
                         f"{fmt(k3['produce_rps'])} | {ratio:.1f} | {fmt(peer['consume_rps'])} | "
                         f"{fmt(k1['consume_rps'])} | {fmt(k3['consume_rps'])} | "
                         f"{fmt(k3['consume_rps_chunks'])} |")
        lines.append("")
    return "\n".join(lines)
