"""Key compaction figures: throughput of a pass and write amplification.

    python -m bench.compaction [--keys 1000] [--rounds 100] [--value 100] [--cluster] [--sweep]
                               [--out bench/results/compaction.json]

In process: a streamlet's worth of 1 MiB segments of keyed chunks (``--keys``
keys written ``--rounds`` times, ``--value``-byte values) is compacted the way
the broker does it: a pass when the dirty bytes reach the compacted ones
(and a last one at the end), each over the compacted segments and the new
ones. Throughput is records and bytes read by the passes per CPU second;
write amplification is the bytes the passes write (in memory: compacted
segments) over the bytes ingested. With ``--cluster``: the same records
produced to a compacted stream on a 3-node cluster (R=3), the time until a
reader sees at most two records per key, and the brokers' counters.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kera import chunk
from kera.broker.compactor import compact
from kera.broker.segment import Segment

SEGMENT = 1 << 20
CHUNK_RECORDS = 256
SWEEP = [(10_000, 100, 100), (100_000, 10, 100), (1000, 100, 10)]   # (keys, rounds, value bytes)


def _segments(keys: int, rounds: int, value: int):
    """Yield filled segments of keyed chunks, in order (1 MiB each, chunks of 256 records)."""
    ks = [b"k%d" % k for k in range(keys)]
    seg, sid, seq = Segment(0, SEGMENT), 0, 0
    for r in range(rounds):
        v = (b"%d-" % r).ljust(value, b"x")
        for a in range(0, keys, CHUNK_RECORDS):
            c = chunk.build(1, 0, 1, seq, [v] * len(ks[a:a + CHUNK_RECORDS]), ks[a:a + CHUNK_RECORDS])
            seq += 1
            if seg.room() < len(c):
                seg.durable = seg.head
                yield seg
                sid += 1
                seg = Segment(sid, SEGMENT)
            off = seg.append(c)
            chunk.place(seg.view, off, 0, seg.id, off)
    seg.durable = seg.head
    yield seg


def in_process(keys: int, rounds: int, value: int) -> dict:
    held: list = []        # (segment, bytes now: compacted or original, compacted?)
    ingested = written = scanned = records_scanned = passes = 0
    cpu = 0.0

    def run_pass():
        nonlocal written, scanned, records_scanned, passes, cpu
        t0 = time.process_time()
        out, _ = compact([(s, d) for s, d, _ in held], int(time.time() * 1000), 86_400_000, True)
        cpu += time.process_time() - t0
        passes += 1
        scanned += sum(len(d) for _, d, _ in held)
        records_scanned += sum(h.record_count for _, d, _ in held for h, _ in chunk.scan(d, False))
        for i, (s, d, _) in enumerate(held):
            new = out.get(s)
            if new is not None:
                written += len(new.buf)
                held[i] = (s, new.buf, True)
            else:
                held[i] = (s, d, True)

    for seg in _segments(keys, rounds, value):
        ingested += seg.head
        held.append((seg, seg.view[:seg.head], False))
        clean = sum(len(d) for _, d, c in held if c)
        dirty = sum(len(d) for _, d, c in held if not c)
        if dirty >= clean:
            run_pass()
    if any(not c for _, _, c in held):
        run_pass()
    records = sum(h.record_count for _, d, _ in held for h, _ in chunk.scan(d, False))
    return {"keys": keys, "rounds": rounds, "value_bytes": value, "records_in": keys * rounds,
            "records_left": records, "ingested_mb": round(ingested / 1e6, 2),
            "left_mb": round(sum(len(d) for _, d, _ in held) / 1e6, 3), "passes": passes,
            "cpu_s": round(cpu, 3), "records_per_s": round(records_scanned / cpu),
            "mb_per_s": round(scanned / cpu / 1e6, 1),
            "write_amplification_memory": round((ingested + written) / ingested, 3),
            "write_amplification_replicated": 1.0}


def on_cluster(keys: int, rounds: int, value: int) -> dict:
    import trio
    from kera_client import open_admin, open_consumer, open_producer

    from .kera_side import KeraRun

    async def go(coord):
        async with open_admin(coord) as adm:
            await adm.create_stream("c", replication=3, cleanup_policy="compact", segment_ms=1000)
        ks = [b"k%d" % k for k in range(keys)]
        t0 = time.monotonic()
        async with open_producer(coord, **{"linger.ms": 5}) as p:
            for r in range(rounds):
                await p.send_many("c", [(b"%d-" % r).ljust(value, b"x")] * keys, ks)
            await p.flush()
        produced = time.monotonic() - t0
        while True:
            n = 0
            async with open_consumer(["c"], coord, start="earliest") as c:
                while chunks := await c.poll_chunks(0.5):
                    n += sum(len(ch) for ch in chunks)
            if n <= 2 * keys:
                break
        done = time.monotonic() - t0
        async with open_admin(coord) as adm:
            stats = [b.get("compaction") for b in await adm.broker_stats()]
            with trio.move_on_after(10):   # the floors move at the next reclaim passes
                while not sum(b.get("reclaimed_bytes", 0) for b in await adm.backup_stats()):
                    await trio.sleep(0.25)
            backups = await adm.backup_stats()
        return {"produce_s": round(produced, 2), "compacted_after_s": round(done, 2),
                "records_left": n, "brokers": [s for s in stats if s and s["passes"]],
                "backup_disk_bytes": sum(b.get("disk_bytes", 0) for b in backups),
                "backup_reclaimed_bytes": sum(b.get("reclaimed_bytes", 0) for b in backups)}

    with KeraRun(3) as run:
        return trio.run(go, run.cluster.coordinator)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--value", type=int, default=100)
    ap.add_argument("--cluster", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also more keys, fewer rounds, smaller values")
    ap.add_argument("--out", default=None, help="write the JSON there too (bench/results/compaction.json)")
    a = ap.parse_args()
    out = {"in_process": [in_process(a.keys, a.rounds, a.value)]}
    if a.cluster:
        out["cluster"] = on_cluster(a.keys, a.rounds, a.value)
    if a.sweep:
        out["in_process"] += [in_process(k, r, v) for k, r, v in SWEEP]
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
