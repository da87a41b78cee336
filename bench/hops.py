"""Per-hop cost: CPU microseconds per chunk at 1-record chunks, and per request, on each hop.

    python -m bench hops [--label NAME] [--streams 512] [--records 60000] [--repeats 3]
                         [--requests 2000]

One producer (this process) sends 100-byte records round-robin over many
single-streamlet R=3 streams with ``chunk.size`` 1, so every chunk holds one
record. Each hop's cost is its process's CPU time (utime + stime from
/proc/<pid>/stat, all threads; the producer's from ``getrusage``) over the
measured workload, divided by the chunks that hop handled: the producer's
chunks built, sealed and sent; the brokers' chunks appended (parse, verify,
append, vlog ref, ack); the backups' chunks written (R - 1 copies of each).
CPU time, not wall time, so the figures hold on a loaded machine. Idle work
(heartbeats) is included and small against the workload.

The per-request figure is the fixed cost of one request on every hop, which
the per-chunk figure (many chunks per request) hides: the producer sends one
100-byte record to one stream with ``linger.ms`` 0 and waits for it
(``send`` + ``flush``), ``--requests`` times in a row, at R=1 and R=3. Each
hop's CPU time over them divided by the requests: the client (this process,
both its threads), the owning broker (a produce, and a replicate to each of
its backups), the backups together (R=1: one replicate; R=3: two).

Results go to bench/results/hops.json under ``--label`` (runs of other
labels are kept, so a before/after pair sits in one file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from .kera_side import KeraRun, own_cpu, proc_cpu

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _cpu(run: KeraRun) -> tuple:
    """CPU seconds so far: this process's, each broker's, each backup's."""
    return (own_cpu(), [proc_cpu(x) for x in run.pids("broker")], [proc_cpu(x) for x in run.pids("backup")])


def one_run(run: KeraRun, streams: list[str], records: int, size: int, replication: int) -> dict:
    from kera_client import Producer

    cfg = {"acks": "all", "linger.ms": 5, "chunk.size": 1}
    p = Producer(run.cluster.coordinator, cfg)
    try:
        p.portal.call(p._p.load_metadata, streams)
        value = b"x" * size
        s = len(streams)
        for i in range(2 * s):  # warm: connections, vlogs, first segments and replica files
            p.send(streams[i % s], value)
        p.flush()
        before, c0, t0 = run.stats(), _cpu(run), time.monotonic()
        send = p.send
        for i in range(records):
            send(streams[i % s], value)
        p.flush()
        wall, c1, after = time.monotonic() - t0, _cpu(run), run.stats()
    finally:
        p.portal.close()
    chunks = after["chunks"] - before["chunks"]
    copies = chunks * (replication - 1)
    prod = c1[0] - c0[0]
    brk = sum(c1[1]) - sum(c0[1])
    bak = sum(c1[2]) - sum(c0[2])
    return {"records": records, "chunks": chunks, "wall_s": round(wall, 2),
            "producer_us": round(prod / records * 1e6, 1),
            "broker_us": round(brk / chunks * 1e6, 1),
            "backup_us": round(bak / copies * 1e6, 1) if copies else None,
            "replicate_rpcs": after["rpcs"] - before["rpcs"],
            "cpu_s": {"producer": round(prod, 2), "brokers": round(brk, 2), "backups": round(bak, 2)}}


def per_request(run: KeraRun, replication: int, requests: int) -> dict:
    """CPU µs per sequential 1-chunk request on each hop (see the module's docstring)."""
    from kera_client import Producer

    stream = run.create(1, replication=replication)
    p = Producer(run.cluster.coordinator, {"acks": "all", "linger.ms": 0})
    try:
        value = b"x" * 100
        for _ in range(200):  # warm: connections, vlog, segment, replica files
            p.send(stream[0], value)
            p.flush()
        before, c0, t0 = run.stats(), _cpu(run), time.monotonic()
        for _ in range(requests):
            p.send(stream[0], value)
            p.flush()
        wall, c1, after = time.monotonic() - t0, _cpu(run), run.stats()
    finally:
        p.portal.close()
    run.delete(stream)
    per = 1e6 / requests
    return {"replication": replication, "requests": requests,
            "wall_us": round(wall * per), "client_us": round((c1[0] - c0[0]) * per),
            "broker_us": round((sum(c1[1]) - sum(c0[1])) * per),
            "backup_us": round((sum(c1[2]) - sum(c0[2])) * per),
            "replicates_per_request": round((after["rpcs"] - before["rpcs"]) / requests, 2)}


def run(args) -> dict:
    load_start = os.getloadavg()
    rows = []
    with KeraRun(args.nodes) as k:
        for r in range(args.repeats):
            streams = k.create(args.streams, replication=3)
            out = one_run(k, streams, args.records, 100, 3)
            print(f"run {r + 1}: {out}", flush=True)
            rows.append(out)
            k.delete(streams)
        requests = []
        for r in (1, 3):
            out = per_request(k, r, args.requests)
            print(f"per request: {out}", flush=True)
            requests.append(out)
    med = {h: statistics.median(x[h] for x in rows) for h in ("producer_us", "broker_us", "backup_us")}
    return {"label": args.label, "streams": args.streams, "records": args.records, "size": 100,
            "replication": 3, "nodes": args.nodes, "median_us_per_chunk": med, "runs": rows,
            "per_request": requests,
            "load_start": load_start, "load_end": os.getloadavg(), "when": time.strftime("%Y-%m-%d %H:%M")}


def main(argv) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench hops")
    ap.add_argument("--label", default="current")
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--records", type=int, default=60_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    res = run(args)
    m = res["median_us_per_chunk"]
    print(f"{args.label}: CPU us per 1-record chunk (median of {args.repeats}): producer {m['producer_us']}, "
          f"broker {m['broker_us']}, backup {m['backup_us']} (load {res['load_start'][0]:.1f} to "
          f"{res['load_end'][0]:.1f})")
    for q in res["per_request"]:
        print(f"{args.label}: CPU us per sequential 1-chunk request, R={q['replication']}: client "
              f"{q['client_us']}, broker {q['broker_us']}, backups {q['backup_us']} "
              f"(wall {q['wall_us']} us)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "hops.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.setdefault("runs", {})[args.label] = res
    old["experiment"] = "hops"
    with open(path, "w") as f:
        json.dump(old, f, indent=1)
    print(f"wrote {path}")
