"""kera beside the peer as streams grow, like for like: ``python -m bench streams [--quick] [--concurrent]``.

Every cell is the same on both sides: 100-byte records; one producer process
calling send() / produce() once per record, records round-robin over the
streams (topics of one partition); acks=all; linger 5 ms; chunk.size =
batch.size = 16 KB, for ``--seconds`` (3; the records it sent are counted);
then one consumer process reading them all and touching every record's value
(``len`` of its bytes) on both sides. Every run lasts the same time whatever
its rate, so a slow cell is not cut short and a fast one not a blip. Rows:

- ``peer``: Tansu, in memory, no replication, no disk;
- ``kera R=1``: no replication across processes (one disk copy on a backup):
  the pair to hold against the peer;
- ``kera R=3``: with replication (3 nodes), work the peer does not do.

kera's chunk-level reading (records counted from chunk headers, values not
touched) is reported in a column of its own. Each cell runs ``--repeats``
times (3) with the systems in a rotating order; the median and the range
(min-max) are reported, every run is in the results file. kera uses one
long-lived 3-node cluster for the whole invocation, whose streams are deleted
after each run, and first warms up with one unreported run of each kera cell
(its first runs pay for memory and files that later runs reuse; without it the
third repeat came out 16-27% faster than the first); the peer gets a fresh
broker per run. Phases: producer alone,
then consumer alone; ``--concurrent`` adds runs with both at once. A phase's
clock starts once its workers are set up and warmed up and the machine is
quiet (``stage.quiet``: the last run's leftovers done, what it waited is in
each run's ``quiet``).

Past 2,048, at 10,000 and 100,000 streams, the peer runs at 10,000 topics
only (``PEER_MAX``: it creates ~250 topics/s past 1,000 here, so 100,000
would take most of an hour per run); kera's streams are created and deleted
in batches there.

The ``acceptance`` block (the targets) is computed from the same runs:
kera R=3 / peer at 512 and 2,048 streams (>= 3x, >= 4x), kera R=3 at 2,048
streams / its own 1-stream rate (>= 0.8), kera R=3 at 100,000 streams / its
own 1-stream rate (>= 0.5), all on medians; and for each kera R=3
cell its last repeat / its first (within 10%: a cluster that ages slows the
later repeats down).

``--auth`` and/or ``--tls`` add a row, ``kera R=3 +auth+tls``: a second long-lived
3-node cluster run in those modes (its clients log in as its admin, over TLS),
measured in the same rotation as the others, at 512 streams too; its target is
R=3 in those modes / R=3 by default at 512 streams (>= 0.9: authentication costs
per connection, not per request).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import urllib.request

from kera.process import free_ports

from .kera_side import KeraRun

SIZE = 100
CFG = {"acks": "all", "linger.ms": 5, "chunk.size": 16384}
SYSTEMS = ("peer", "kera R=1", "kera R=3")
COUNTS = [1, 128, 512, 2048, 10_000, 100_000]
PEER_MAX = 10_000                  # topics: the peer's largest cell
QUICK_COUNTS = [1, 2048]
SECONDS, QUICK_SECONDS = 3.0, 1.0  # each producer phase alone lasts this long (records counted)
MAX_RATE = 2_000_000               # records/s: a timed phase's cap on records, never reached


def _size(n: int, seconds: float, concurrent: bool) -> tuple[int, float]:
    """(records, seconds) of one producer phase: timed alone, counted when concurrent."""
    return (n, 0.0) if concurrent else (int(MAX_RATE * seconds), seconds)


def _run_kera(k: KeraRun, r: int, streams: int, n: int, seconds: float, concurrent: bool) -> dict:
    t0 = time.monotonic()
    names = k.create(streams, replication=r)
    create_s = round(time.monotonic() - t0, 3)
    k.idle()   # the new streams' assignment done: the run measures its produce
    n, seconds = _size(n, seconds, concurrent)
    try:
        out = k.measure(names, n, SIZE, 1, 1, CFG, sequential=not concurrent, touch=True,
                        chunk_read=not concurrent, seconds=seconds)
    finally:
        k.delete(names)
    return {**out, "create_s": create_s, "idle_after_delete_s": k.idle_s}


def _run_peer(streams: int, n: int, seconds: float, concurrent: bool) -> dict:
    from .peer import run_peer
    n, seconds = _size(n, seconds, concurrent)
    out = run_peer(streams, n, SIZE, 1, 1, linger_ms=CFG["linger.ms"], batch_size=CFG["chunk.size"],
                   count="sampled", sequential=not concurrent, touch=True, seconds=seconds)
    return {key: out.get(key) for key in ("produced", "produce_rps", "consumed", "consume_rps",
                                          "produce_p50_ms", "produce_p99_ms", "create_topics_s", "quiet")}


def _stat(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values)), "min": round(min(values)), "max": round(max(values)),
            "runs": len(values)}


def _check(value: float | None, bound: str) -> dict:
    """One acceptance figure against its bound (">=3", "within 10%")."""
    if value is None:
        return {"value": None, "bound": bound, "pass": None}
    ok = abs(value - 1) <= 0.10 if bound == "within 10%" else value >= float(bound[2:])
    return {"value": round(value, 3), "bound": bound, "pass": ok}


def acceptance(cells: list[dict], runs: list[dict], repeats: int) -> dict:
    """Issue 12's point 1, from the medians and runs of the sequential phase."""
    med = {(c["system"], c["streams"]): c["produce_rps"]["median"]
           for c in cells if c["phase"] == "sequential" and c["produce_rps"]}

    def ratio(a, b):
        return med[a] / med[b] if a in med and b in med and med[b] else None

    out = {"r3_vs_peer@512": _check(ratio(("kera R=3", 512), ("peer", 512)), ">=3"),
           "r3_vs_peer@2048": _check(ratio(("kera R=3", 2048), ("peer", 2048)), ">=4"),
           "r3@2048_vs_r3@1": _check(ratio(("kera R=3", 2048), ("kera R=3", 1)), ">=0.8"),
           "r3@100000_vs_r3@1": _check(ratio(("kera R=3", 100_000), ("kera R=3", 1)), ">=0.5")}
    last = repeats - 1
    drift = {}
    for s in sorted({r["streams"] for r in runs}):
        mine = {r["repeat"]: r["produce_rps"] for r in runs
                if (r["system"], r["streams"], r["phase"]) == ("kera R=3", s, "sequential")}
        if 0 in mine and last in mine and last > 0:
            drift[str(s)] = _check(mine[last] / mine[0], "within 10%")
    out[f"r3_repeat{last + 1}_vs_repeat1"] = {
        "cells": drift, "pass": all(d["pass"] for d in drift.values()) if drift else None,
        "failing_streams": [int(s) for s, d in drift.items() if not d["pass"]]}
    return out


def secure_name(auth: bool, tls: bool) -> str:
    return "kera R=3 " + "".join(m for m, on in (("+auth", auth), ("+tls", tls)) if on)


def run(counts: list[int], n: int, seconds: float, repeats: int, concurrent: bool, say,
        auth: bool = False, tls: bool = False) -> dict:
    runs: list[dict] = []
    phases = ["sequential"] + (["concurrent"] if concurrent else [])
    load_start = os.getloadavg()
    secure = secure_name(auth, tls) if auth or tls else None
    systems = SYSTEMS + ((secure,) if secure else ())
    if secure and 512 not in counts:
        counts = sorted({*counts, 512})
    with KeraRun(3) as k, (KeraRun(3, auth=auth, tls=tls) if secure else _Nothing()) as ks:
        def kera(system, s, secs, conc):
            return _run_kera(ks if system == secure else k, 3 if system == secure else int(system[-1]),
                             s, n, secs, conc)

        for s in counts:   # warm-up, not reported: the long-lived cluster's first runs pay for
            for system in systems[1:]:   # memory and files that later runs reuse
                say(f"streams: warm-up, {s} streams, {system}")
                kera(system, s, min(seconds, 1.0), False)
        for rep in range(repeats):
            for s in counts:
                for phase in phases:
                    at = rep % len(systems)
                    order = systems[at:] + systems[:at]   # rotate who goes first
                    for system in order:
                        if system == "peer" and s > PEER_MAX:
                            continue
                        say(f"streams: repeat {rep + 1}/{repeats}, {s} streams, {phase}, {system}")
                        conc = phase == "concurrent"
                        out = _run_peer(s, n, seconds, conc) if system == "peer" else \
                            kera(system, s, seconds, conc)
                        runs.append({"system": system, "streams": s, "phase": phase, "repeat": rep, **out})
                        say(f"   produce {out['produce_rps']:,}/s, consume {out.get('consume_rps') or 0:,}/s")
    cells = []
    for phase in phases:
        for s in counts:
            for system in systems:
                mine = [r for r in runs if (r["system"], r["streams"], r["phase"]) == (system, s, phase)]
                cells.append({"system": system, "streams": s, "phase": phase,
                              "produce_rps": _stat([r["produce_rps"] for r in mine]),
                              "consume_rps": _stat([r.get("consume_rps") for r in mine]),
                              "consume_rps_chunks": _stat([r.get("consume_rps_chunks") for r in mine]),
                              "produce_p99_ms": _stat([r.get("produce_p99_ms") for r in mine])})
    acc = acceptance(cells, runs, repeats)
    if secure:
        med = {c["system"]: c["produce_rps"]["median"] for c in cells
               if c["phase"] == "sequential" and c["streams"] == 512 and c["produce_rps"]}
        base = med.get("kera R=3")
        acc["secure_r3_vs_r3@512"] = _check(med[secure] / base if base and secure in med else None, ">=0.9")
        mine = [r for r in runs if (r["system"], r["streams"], r["phase"]) == (secure, 512, "sequential")]
        if base and mine:
            acc["secure_floor@512"] = tls_ceiling(base, sum(r["bytes_in"] for r in mine) /
                                                  max(1, sum(r["records_in"] for r in mine)))
    return {"experiment": "streams", "phase_seconds": seconds, "records": n, "size": SIZE, "config": CFG, "repeats": repeats,
            "producers": 1, "consumers": 1, "nodes": 3, "cells": cells, "secure": secure,
            "acceptance": acc, "runs": runs,
            "load": {"start": load_start, "end": os.getloadavg()}}


def tls_ceiling(plain_rps: float, bytes_per_record: float) -> dict:
    """The best secure / default ratio at 512 streams on this machine: the ssl module's own
    cost per byte (``tls_floor``) over the bytes a record takes across TLS at R=3 (its share
    of the produce requests, ``bytes_per_record``, three crossings), added to the CPU a
    record costs by default with every core busy."""
    from .tls_floor import CROSSINGS_R3, SUITES, ceiling, measure
    floor = measure(64, SUITES[:1])["suites"][0]
    per_record = bytes_per_record * CROSSINGS_R3
    return {"suite": floor["suite"], "crossing_ns_per_byte": floor["crossing_ns_per_byte"],
            "tls_bytes_per_record": round(per_record, 1),
            **ceiling(floor["crossing_ns_per_byte"], per_record, plain_rps, os.cpu_count() or 1)}


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def table(res: dict) -> str:
    def fmt(st):
        if not st:
            return ""
        return f"{st['median'] / 1000:.0f}k ({st['min'] / 1000:.0f}-{st['max'] / 1000:.0f}k)"

    def ratio(a, b):
        return f"{a['median'] / b['median']:.1f}" if a and b and b["median"] else ""

    lines = []
    for phase in sorted({c["phase"] for c in res["cells"]}, reverse=True):
        what = "producer alone, then consumer alone" if phase == "sequential" else "producer and consumer at once"
        lines += [f"{what}: records/s, median (min-max) of {res['repeats']} runs", "",
                  "| streams | peer produce | kera R=1 produce | kera R=3 produce | R=1 / peer | R=3 / peer | "
                  "peer consume | kera R=1 consume | kera R=3 consume | kera R=3 consume, chunk-level |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        by = {(c["system"], c["streams"]): c for c in res["cells"] if c["phase"] == phase}
        for s in sorted({c["streams"] for c in res["cells"]}):
            peer, k1, k3 = by[("peer", s)], by[("kera R=1", s)], by[("kera R=3", s)]
            if not peer["produce_rps"]:   # past PEER_MAX
                peer = {"produce_rps": None, "consume_rps": None}
            lines.append(f"| {s} | {fmt(peer['produce_rps'])} | {fmt(k1['produce_rps'])} | "
                         f"{fmt(k3['produce_rps'])} | {ratio(k1['produce_rps'], peer['produce_rps'])} | "
                         f"{ratio(k3['produce_rps'], peer['produce_rps'])} | {fmt(peer['consume_rps'])} | "
                         f"{fmt(k1['consume_rps'])} | {fmt(k3['consume_rps'])} | "
                         f"{fmt(k3['consume_rps_chunks'])} |")
        lines.append("")
        if res.get("secure"):
            lines += [f"{what}: kera R=3 by default and {res['secure']}, records/s, median (min-max)", "",
                      f"| streams | kera R=3 produce | {res['secure']} produce | ratio | kera R=3 consume | "
                      f"{res['secure']} consume | ratio |", "|---|---|---|---|---|---|---|"]
            for s in sorted({c["streams"] for c in res["cells"]}):
                k3, ks = by[("kera R=3", s)], by[(res["secure"], s)]
                lines.append(f"| {s} | {fmt(k3['produce_rps'])} | {fmt(ks['produce_rps'])} | "
                             f"{ratio(ks['produce_rps'], k3['produce_rps'])} | {fmt(k3['consume_rps'])} | "
                             f"{fmt(ks['consume_rps'])} | {ratio(ks['consume_rps'], k3['consume_rps'])} |")
            lines.append("")
    lines.append("targets, from these runs:")
    for name, a in res["acceptance"].items():
        if "ceiling" in a:
            lines.append(f"  {name}: {a['suite']} costs {a['crossing_ns_per_byte']} ns per byte crossing "
                         f"TLS, {a['tls_bytes_per_record']} bytes cross per record at R=3: "
                         f"{a['tls_floor_us_per_record']} us beside {a['cpu_us_per_record']} us a record "
                         f"costs by default, so at best {a['ceiling']}x")
        elif "cells" in a:
            each = ", ".join(f"{s} streams {d['value']}" for s, d in a["cells"].items())
            verdict = {True: "pass", False: f"FAIL at {a['failing_streams']} streams", None: "n/a"}[a["pass"]]
            lines.append(f"  {name} (kera R=3, within 10%): {each}: {verdict}")
        else:
            verdict = {True: "pass", False: "FAIL", None: "n/a"}[a["pass"]]
            lines.append(f"  {name} ({a['bound']}): {a['value']}: {verdict}")
    return "\n".join(lines)


# -- what metrics cost: ``python -m bench streams --quick --metrics`` ------------------------------
METRICS_STREAMS = 512



class Scraper:
    """Every endpoint of a cluster scraped once a second, as Prometheus would, on a thread of
    the bench process for as long as it runs."""

    def __init__(self, addrs: list[str], every: float = 1.0):
        self.addrs, self.every = addrs, every
        self.stop = threading.Event()
        self.scrapes = self.failures = 0
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for a in self.addrs:
                try:
                    with urllib.request.urlopen(f"http://{a}/metrics", timeout=5) as r:
                        self.bytes += len(r.read())
                    self.scrapes += 1
                except OSError:
                    self.failures += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def metrics_cost(n: int, seconds: float, repeats: int, say) -> dict:
    """kera R=3 at 512 streams on two clusters alive at once, one serving metrics scraped every
    second and one without endpoints, their runs paired and alternating who goes first."""
    runs = []
    with KeraRun(3) as plain, KeraRun(3, metrics_port=free_ports(7)) as measured:
        addrs = list(measured.cluster.metrics_addrs().values())
        with Scraper(addrs) as scraper:
            for k, mode in ((plain, "without"), (measured, "scraped")):   # warm-up, not reported
                say(f"metrics: warm-up, {mode}")
                _run_kera(k, 3, METRICS_STREAMS, n, min(seconds, 1.0), False)
            for rep in range(repeats):
                order = [(plain, "without"), (measured, "scraped")]
                for k, mode in (order if rep % 2 == 0 else order[::-1]):
                    say(f"metrics: repeat {rep + 1}/{repeats}, {METRICS_STREAMS} streams, R=3, {mode}")
                    out = _run_kera(k, 3, METRICS_STREAMS, n, seconds, False)
                    runs.append({"mode": mode, "repeat": rep, **out})
                    say(f"   produce {out['produce_rps']:,}/s, consume {out.get('consume_rps') or 0:,}/s")
        scrapes = {"scrapes": scraper.scrapes, "failures": scraper.failures,
                   "bytes_per_scrape": scraper.bytes // max(1, scraper.scrapes)}
    cells = {mode: {"produce_rps": _stat([r["produce_rps"] for r in runs if r["mode"] == mode]),
                    "consume_rps": _stat([r.get("consume_rps") for r in runs if r["mode"] == mode]),
                    "produce_p99_ms": _stat([r.get("produce_p99_ms") for r in runs if r["mode"] == mode])}
             for mode in ("without", "scraped")}
    pairs = []
    for rep in range(repeats):
        a = next(r for r in runs if (r["mode"], r["repeat"]) == ("scraped", rep))
        b = next(r for r in runs if (r["mode"], r["repeat"]) == ("without", rep))
        pairs.append(round(a["produce_rps"] / b["produce_rps"], 3) if b["produce_rps"] else None)
    return {"experiment": "streams-metrics", "streams": METRICS_STREAMS, "phase_seconds": seconds,
            "repeats": repeats, "cells": cells, "paired_produce_ratios": pairs, "scraper": scrapes,
            "runs": runs}


def metrics_table(res: dict) -> str:
    def fmt(st):
        return f"{st['median']:,} ({st['min']:,}-{st['max']:,})" if st else ""

    c = res["cells"]
    return "\n".join([
        f"kera R=3, {res['streams']} streams, records/s, median (min-max) of {res['repeats']} paired runs",
        "", "| | produce | consume | produce p99 ms |", "|---|---|---|---|",
        *(f"| {m} | {fmt(c[m]['produce_rps'])} | {fmt(c[m]['consume_rps'])} | "
          f"{fmt(c[m]['produce_p99_ms'])} |" for m in ("without", "scraped")),
        "", f"scraped / without, produce, per pair: {res['paired_produce_ratios']}",
        f"scrapes: {res['scraper']}"])
