"""Produce-ack latency against offered load: ``python -m bench latency [--quick]``.

128 streams, 100-byte records, one producer process pacing its send() /
produce() calls to the offered load, acks=all, linger 1 ms, chunk.size =
batch.size = 16 KB, on both sides. Both sides measure per record, from the
call to its delivery report, every 100th record (kera's
``DeliveryReport.latency``, librdkafka's ``Message.latency()``).

First kera R=3's maximum rate at 128 streams with the same settings is
measured (the producer unpaced for ``CALIBRATE_S``); the offered loads are
then fractions of it, each point about ``POINT_S`` seconds of records, the
systems in rotating order. The ``acceptance`` block holds issue 12's point 2:
kera R=3's p99 at half its maximum rate (<= 10 ms), with the peer's p99 at
the same offered load beside it.
"""

from __future__ import annotations

from .kera_side import KeraRun

STREAMS = 128
CFG = {"acks": "all", "linger.ms": 1, "chunk.size": 16384}
FRACTIONS, QUICK_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75), (0.1, 0.5)
CALIBRATE_S, POINT_S = 3.0, 4.0
TARGET_P99_MS = 10.0
KEYS = ("produced", "produce_rps", "produce_p50_ms", "produce_p99_ms", "produce_p999_ms")


def _kera(k: KeraRun, r: int, load: int) -> dict:
    streams = k.create(STREAMS, replication=r)
    try:
        return k.measure(streams, int(load * POINT_S), 100, 1, 0, CFG, rate=load)
    finally:
        k.delete(streams)


def max_rate(k: KeraRun) -> int:
    """kera R=3's records/s at 128 streams, producer unpaced, the latency settings."""
    streams = k.create(STREAMS, replication=3)
    try:
        out = k.measure(streams, int(2_000_000 * CALIBRATE_S), 100, 1, 0, CFG, sequential=True,
                        seconds=CALIBRATE_S)
    finally:
        k.delete(streams)
    return out["produce_rps"]


def acceptance(rows: list[dict], half: int) -> dict:
    at = {r["system"]: r for r in rows if r["offered"] == half}
    p99 = at.get("kera R=3", {}).get("produce_p99_ms")
    return {"offered": half, "kera_r3_p99_ms": p99, "peer_p99_ms": at.get("peer", {}).get("produce_p99_ms"),
            "bound_ms": TARGET_P99_MS, "pass": None if p99 is None else p99 <= TARGET_P99_MS}


def run(args, say) -> dict:
    from .peer import run_peer
    rows = []
    with KeraRun(args.nodes) as k:
        top = max_rate(k)
        say(f"latency: kera R=3 maximum at {STREAMS} streams: {top:,} records/s")
        loads = sorted({max(1000, int(round(top * f, -3))) for f in (QUICK_FRACTIONS if args.quick else FRACTIONS)})
        half = max(1000, int(round(top * 0.5, -3)))
        for i, load in enumerate(loads):
            order = ["peer", "kera R=1", "kera R=3"]
            order = order[i % 3:] + order[:i % 3]
            for system in order:
                say(f"latency: {system}, offered {load:,} records/s")
                if system == "peer":
                    out = run_peer(STREAMS, int(load * POINT_S), 100, 1, 0, linger_ms=CFG["linger.ms"],
                                   batch_size=CFG["chunk.size"], count="sampled", rate=load)
                else:
                    out = _kera(k, int(system[-1]), load)
                rows.append({"system": system, "offered": load, "streams": STREAMS,
                             **{key: out.get(key) for key in KEYS}})
                say(f"   {rows[-1]}")
    return {"experiment": "latency", "rows": rows, "nodes": args.nodes, "config": CFG, "streams": STREAMS,
            "max_rps": top, "acceptance": acceptance(rows, half)}
