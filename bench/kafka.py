"""The same librdkafka client on both sides: kera's Kafka listener (R=1, R=3) beside the peer,
and kera's own client on the R=3 cluster as the listener's yardstick.

    python -m bench kafka [--quick] [--counts 1,128,512,2048] [--records N] [--repeats 3]
                          [--systems peer,kera R=1,kera R=3,kera R=3 own]

One producer process, then one consumer process (confluent-kafka, ``bench.peer``'s workers,
unchanged): 100-byte records round-robin over N one-partition topics, linger 5 ms,
batch.size 16 KB, acks=all. Each cell is run ``repeats`` times with the systems in a
rotating order; medians are reported, and each target of the Kafka issue against them
(``checks``). "kera R=3 own" is kera's own producer (Python, one ``send()`` per record,
linger 5 ms, 16 KB chunks, acks=all) on the same cluster and topics: the same record
shape through kera's protocol (produce only). kera runs 3 nodes (broker + backup each) with a
Kafka listener per broker; topics are created with CreateTopics. Writes
bench/results/kafka.json and kafka.png (not with --quick).

Per hop on kera's side (``hops`` of a row): each kind of server's CPU time (utime + stime
from /proc, all processes of the kind) over the produce stage, in µs per Kafka Produce
request and per record batch the brokers took (librdkafka sends one partition per request
here, so the two differ only when a request carries several). CPU, not wall time: the
figures hold on a loaded machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time

from kera.cluster import LocalCluster

from .kera_side import proc_cpu
from .peer import consume_worker, create_topics, high_watermarks, produce_worker, run_peer
from .stage import run_stage, summarize

RESULTS = os.path.join(os.path.dirname(__file__), "results")
LINGER, BATCH, SIZE = 5, 16384, 100
TARGETS = {"r3_over_peer_512": 3.0, "r3_over_peer_2048": 4.0, "r3_2048_over_own_1": 0.8,
           "listener_over_own_512": 0.8}


class KeraKafka:
    """A 3-node kera cluster with Kafka listeners, topics created once for a series of runs."""

    def __init__(self, replication: int, topics: list[str]):
        from kera.process import free_ports
        self.dir = tempfile.mkdtemp(prefix="kera-bench-kafka-")
        self.cluster = LocalCluster(os.path.join(self.dir, "data"), 3, port=0, kafka_port=free_ports(3))
        self.replication, self.topics = replication, topics

    def __enter__(self):
        self.cluster.start()
        self.bootstrap = self.cluster.kafka_bootstrap()
        create_topics(self.bootstrap, self.topics, 1, 120.0, self.replication)
        return self

    def __exit__(self, *exc):
        self.cluster.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, n_records: int) -> dict:
        """One producer alone, then one consumer of what it wrote (as ``run_peer`` sequential)."""
        ctx = multiprocessing.get_context("spawn")
        start = high_watermarks(self.bootstrap, self.topics)
        pj = [("p", 0, produce_worker, (self.bootstrap, self.topics, n_records, SIZE, LINGER, BATCH, "all"),
               {"count": "callback"})]
        h0 = self.counters()
        outs = run_stage(ctx, pj, 360)
        h1 = self.counters()
        cj = [("c", 0, consume_worker, (self.bootstrap, self.topics, outs[("p", 0)]["records"], 300),
               {"start_offsets": start, "touch": True})]
        outs.update(run_stage(ctx, cj, 360))
        return {**summarize([outs[("p", 0)]], [outs[("c", 0)]], outs[("c", 0)]["t_start"]),
                "hops": hops(h0, h1)}

    def run_own(self, n_records: int) -> dict:
        """kera's own producer on the same topics (streams) with the same record shape: one
        process, one ``send()`` per record round-robin, linger 5 ms, chunks of 16 KB,
        acks=all; its first pass over the topics not counted (librdkafka's metadata
        warm-up). Produce only: what it wrote is read by nobody."""
        from .kera_side import produce_worker as own_producer
        ctx = multiprocessing.get_context("spawn")
        cfg = {"acks": "all", "linger.ms": LINGER, "chunk.size": BATCH}
        pj = [("p", 0, own_producer, (self.cluster.coordinator, self.topics, n_records, SIZE, cfg),
               {"warmup": len(self.topics)})]
        out = run_stage(ctx, pj, 360)[("p", 0)]
        return {"produce_rps": round(out["records"] / (out["t_end"] - out["t_start"]))}

    def counters(self) -> dict:
        """CPU seconds so far per kind of server, and the produce requests and batches the
        brokers' Kafka listeners took."""
        import trio
        from kera_client import open_admin

        async def go():
            async with open_admin(self.cluster.coordinator) as a:
                return await a.broker_stats()
        st = trio.run(go)
        out = {kind: sum(proc_cpu(p.pid) for name, p in self.cluster.procs.items()
                         if name.split("-")[-1].rstrip("0123456789") == kind)
               for kind in ("coordinator", "broker", "backup")}
        for k in ("produce_requests", "produce_batches"):
            out[k] = sum(r.get("kafka", {}).get(k, 0) for r in st)
        return out


def hops(h0: dict, h1: dict) -> dict:
    """Each kind of server's CPU µs per Produce request and per batch between two ``counters``."""
    req = h1["produce_requests"] - h0["produce_requests"]
    bat = h1["produce_batches"] - h0["produce_batches"]
    out: dict = {"requests": req, "batches": bat}
    for kind in ("broker", "backup", "coordinator"):
        cpu = h1[kind] - h0[kind]
        out[f"{kind}_cpu_s"] = round(cpu, 2)
        out[f"{kind}_us_per_request"] = round(cpu / req * 1e6, 1) if req else None
        out[f"{kind}_us_per_batch"] = round(cpu / bat * 1e6, 1) if bat else None
    return out


def cell(system: str, n_topics: int, n_records: int, clusters: dict) -> dict:
    if system == "peer":
        r = run_peer(n_topics, n_records, SIZE, 1, 1, LINGER, BATCH, sequential=True, touch=True)
    elif system == OWN:
        r = clusters["kera R=3"].run_own(n_records)
    else:
        r = clusters[system].run(n_records)
    return {"system": system, "topics": n_topics, "produce_rps": r["produce_rps"],
            "consume_rps": r.get("consume_rps"), "produce_p50_ms": r.get("produce_p50_ms"),
            "produce_p99_ms": r.get("produce_p99_ms"), **({"hops": r["hops"]} if "hops" in r else {})}


OWN = "kera R=3 own"   # kera's own client against the R=3 cluster: the listener's yardstick
SYSTEMS = ["peer", "kera R=1", "kera R=3", OWN]


def run(counts: list[int], n_records: int, repeats: int, systems: list[str] = SYSTEMS) -> dict:
    rows = []
    for n in counts:
        topics = [f"t{i:05d}" for i in range(n)]
        with contextlib.ExitStack() as stack:
            kinds = {s for s in systems if s != "peer"} | ({"kera R=3"} if OWN in systems else set())
            clusters = {s: stack.enter_context(KeraKafka(int(s[-1]), topics)) for s in sorted(kinds) if s != OWN}
            for rep in range(repeats):
                order = systems[rep % len(systems):] + systems[:rep % len(systems)]
                for s in order:
                    r = cell(s, n, n_records, clusters)
                    r["repeat"] = rep
                    print(json.dumps(r), flush=True)
                    rows.append(r)
    m = medians(rows)
    return {"experiment": "kafka", "records": n_records, "size": SIZE, "linger_ms": LINGER,
            "batch_size": BATCH, "acks": "all", "repeats": repeats, "rows": rows,
            "medians": m, "hops": hop_medians(rows), "targets": TARGETS, "checks": checks(m)}


def checks(m: dict) -> dict:
    """Each target against the run's medians of produce records/s (None: a cell not run)."""
    def ratio(a: str, na: int, b: str, nb: int):
        x, y = m.get(a, {}).get(na), m.get(b, {}).get(nb)
        return round(x["produce"] / y["produce"], 3) if x and y and y["produce"] else None
    got = {"r3_over_peer_512": ratio("kera R=3", 512, "peer", 512),
           "r3_over_peer_2048": ratio("kera R=3", 2048, "peer", 2048),
           "r3_2048_over_own_1": ratio("kera R=3", 2048, "kera R=3", 1),
           "listener_over_own_512": ratio("kera R=3", 512, OWN, 512)}
    out = {k: {"value": v, "bound": TARGETS[k], "pass": v is not None and v >= TARGETS[k]}
           for k, v in got.items()}
    out["listener_over_own"] = {n: ratio("kera R=3", n, OWN, n) for n in sorted(m.get(OWN, {}))}
    return out


def hop_medians(rows: list[dict]) -> dict:
    """Per kera system and topic count, the median of each hop's µs per request and per batch."""
    out: dict = {}
    for r in rows:
        for k, v in r.get("hops", {}).items():
            if k.endswith(("_per_request", "_per_batch")) and v is not None:
                out.setdefault(r["system"], {}).setdefault(r["topics"], {}).setdefault(k, []).append(v)
    return {s: {n: {k: round(statistics.median(v), 1) for k, v in d.items()} for n, d in by.items()}
            for s, by in out.items()}


def medians(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["system"], {}).setdefault(r["topics"], {"produce": [], "consume": []})
        out[r["system"]][r["topics"]]["produce"].append(r["produce_rps"])
        if r.get("consume_rps") is not None:
            out[r["system"]][r["topics"]]["consume"].append(r["consume_rps"])
    return {s: {n: {k: statistics.median(v) if v else None for k, v in d.items()} for n, d in by.items()}
            for s, by in out.items()}


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what in zip(axes, ("produce", "consume"), strict=True):
        for s, by in res["medians"].items():
            ns = sorted(by)
            if all(by[n][what] is not None for n in ns):
                ax.plot(ns, [by[n][what] for n in ns], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("topics (one partition each)")
        ax.set_ylabel("records/s (median)")
        ax.set_title(f"{what}, one librdkafka process")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench kafka")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--counts", default="")
    ap.add_argument("--records", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of: " + ", ".join(SYSTEMS))
    ap.add_argument("--out", default=RESULTS)
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.counts.split(",")] if a.counts else ([1, 128] if a.quick else [1, 128, 512, 2048])
    n = a.records or (50_000 if a.quick else 400_000)
    t0 = time.monotonic()
    systems = [s.strip() for s in a.systems.split(",")]
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: each of {SYSTEMS}")
    res = run(counts, n, 1 if a.quick else a.repeats, systems)
    res["seconds"] = round(time.monotonic() - t0, 1)
    m = res["medians"]
    for s, by in m.items():
        print(s, {k: (round(v["produce"]), v["consume"] and round(v["consume"])) for k, v in sorted(by.items())})
    for s, by in res["hops"].items():
        for n, d in sorted(by.items()):
            print(s, n, "topics, CPU us per request / per batch:", {
                kind: (d.get(f"{kind}_us_per_request"), d.get(f"{kind}_us_per_batch"))
                for kind in ("broker", "backup", "coordinator")})
    for k, c in res["checks"].items():
        print(k, c)
    if not a.quick:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kafka.json"), "w") as f:
            json.dump(res, f, indent=1)
        plot(res, os.path.join(a.out, "kafka.png"))
        print(f"wrote {a.out}/kafka.json and kafka.png")
