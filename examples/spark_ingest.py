"""Ingest many kera streams into parquet with one Spark structured streaming query.

Against a running cluster (``kera up`` in another terminal):

    python examples/spark_ingest.py --coordinator 127.0.0.1:7700

writes synthetic records into 200 streams (``ingest-000`` ... ``ingest-199``),
ingests all of them with one streaming query (``pattern=ingest-*``,
``Trigger.AvailableNow``) into parquet, then prints how many records each
stream got. ``--profile`` also reports where the time went: inside the kera
data source (pulling and building Arrow batches, from the ``statsFile``
option) versus the rest of Spark.

Needs ``pip install "pyspark>=4.2" pyarrow`` and Java 17.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from kera_client import Admin, Producer
from kera_client.admin import default_coordinator


def create_streams(coord: str, names: list[str], streamlets: int) -> None:
    with Admin(coord) as a:
        existing = {s.name for s in a.list_streams(None)}
        for n in names:
            if n not in existing:
                a.create_stream(n, streamlets=streamlets)


def produce(coord: str, names: list[str], per_stream: int, size: int) -> int:
    """``per_stream`` records of ``size`` bytes into each stream; values carry (stream, counter)."""
    t = time.perf_counter()
    with Producer(coord, acks="all") as p:
        for k, n in enumerate(names):
            vals = np.full((per_stream, size), ord("x"), dtype=np.uint8)
            vals[:, 0:4] = np.frombuffer(np.uint32(k).tobytes(), np.uint8)
            vals[:, 4:12] = np.arange(per_stream, dtype="<u8").view(np.uint8).reshape(per_stream, 8)
            p.send_many(n, vals)
        p.flush()
        acked = p.acked
    took = time.perf_counter() - t
    print(f"wrote {acked:,} records of {size} bytes into {len(names)} streams in {took:.1f} s "
          f"({acked / took:,.0f} records/s, acks=all)")
    return acked


def spark_session(master: str):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors need this venv (pyarrow, kera)
    from kera_client.spark import KeraDataSource
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("kera-ingest")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(KeraDataSource)   # the one line: format("kera") from now on
    return spark


def ingest(spark, coord: str, pattern: str, out: str, stats: str | None, sink: str = "parquet",
           max_records: int | None = None):
    reader = (spark.readStream.format("kera")
              .option("coordinator", coord)
              .option("pattern", pattern))
    if stats:
        reader = reader.option("statsFile", stats)
    if max_records:
        reader = reader.option("maxRecordsPerTrigger", max_records)
    w = reader.load().writeStream.option("checkpointLocation", os.path.join(out, "_checkpoint"))
    w = w.format("noop") if sink == "noop" else w.format("parquet").option("path", os.path.join(out, "data"))
    t = time.perf_counter()
    q = w.trigger(availableNow=True).start()
    q.awaitTermination()
    took = time.perf_counter() - t
    if q.exception() is not None:
        raise SystemExit(f"query failed: {q.exception()}")
    return took, q.recentProgress


def report_profile(progress, took: float, stats: str, cores: int) -> None:
    rows = sum(p["numInputRows"] for p in progress)
    add = sum(p["durationMs"].get("addBatch", 0) for p in progress) / 1000
    trig = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    tasks = [json.loads(line) for line in open(stats)] if os.path.exists(stats) else []
    src = sum(t["source_s"] for t in tasks)
    task = sum(t["task_s"] for t in tasks)
    pull = sum(t["pull_s"] for t in tasks)
    dec = sum(t["decode_s"] for t in tasks)
    print(f"micro-batches: {len(progress)}, records: {rows:,}, query wall time {took:.1f} s, "
          f"batches {trig:.1f} s (addBatch {add:.1f} s)")
    print(f"ingest rate: {rows / took:,.0f} records/s end to end, {rows / max(add, 1e-9):,.0f} records/s "
          f"while executing batches")
    busy = add * cores
    print(f"kera data source: {src:.2f} s inside read() over {len(tasks)} tasks (waiting for brokers "
          f"{pull:.2f} s, scanning chunks + building Arrow {dec:.2f} s); the read tasks lasted {task:.2f} s, "
          f"the rest being Spark taking the batches in")
    print(f"share of the {busy:.1f} core-seconds of batch execution ({cores} cores x addBatch): "
          f"data source {100 * src / max(busy, 1e-9):.0f}%, Spark {100 - 100 * src / max(busy, 1e-9):.0f}%")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", default=default_coordinator(),
                    help="HOST:PORT of the kera coordinator (default: $KERA_COORDINATOR or 127.0.0.1:7700)")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--records", type=int, default=200_000, help="records in total, spread evenly")
    ap.add_argument("--size", type=int, default=100, help="value size in bytes")
    ap.add_argument("--streamlets", type=int, default=1)
    ap.add_argument("--prefix", default="ingest-", help="stream names: PREFIX000, PREFIX001, ...")
    ap.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--sink", choices=["parquet", "noop"], default="parquet",
                    help="noop measures ingestion without the parquet writer")
    ap.add_argument("--max-records-per-trigger", type=int, default=None)
    ap.add_argument("--skip-write", action="store_true", help="streams are already filled")
    ap.add_argument("--warmup", action="store_true",
                    help="run a small query first so the figures exclude JVM/Python worker start-up")
    ap.add_argument("--profile", action="store_true", help="report time in the data source vs Spark")
    args = ap.parse_args(argv)

    names = [f"{args.prefix}{i:03d}" for i in range(args.streams)]
    per = args.records // args.streams
    if not args.skip_write:
        create_streams(args.coordinator, names, args.streamlets)
        produce(args.coordinator, names, per, args.size)

    out = args.out or tempfile.mkdtemp(prefix="kera-ingest-")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    spark = spark_session(args.master)
    try:
        if args.warmup:
            create_streams(args.coordinator, ["warmup-0"], 1)
            produce(args.coordinator, ["warmup-0"], 10_000, args.size)
            ingest(spark, args.coordinator, "warmup-*", os.path.join(out, "warmup"), None, args.sink)
        stats = os.path.join(out, "source-stats.jsonl") if args.profile else None
        took, progress = ingest(spark, args.coordinator, f"{args.prefix}*", os.path.join(out, "ingest"),
                                stats, args.sink, args.max_records_per_trigger)
        rows = sum(p["numInputRows"] for p in progress)
        print(f"ingested {rows:,} records from {len(names)} streams in {took:.1f} s "
              f"({rows / took:,.0f} records/s, {len(progress)} micro-batches)")
        if args.profile:
            report_profile(progress, took, stats, spark.sparkContext.defaultParallelism)
        if args.sink == "parquet":
            df = spark.read.parquet(os.path.join(out, "ingest", "data"))
            counts = {r["stream"]: r["count"] for r in df.groupBy("stream").count().collect()}
            print("records per stream (parquet):")
            line = []
            for n in sorted(counts):
                line.append(f"{n}={counts[n]}")
                if len(line) == 6:
                    print("  " + "  ".join(line))
                    line = []
            if line:
                print("  " + "  ".join(line))
            total = sum(counts.values())
            print(f"total {total:,} records in {len(counts)} streams; output in {out}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
