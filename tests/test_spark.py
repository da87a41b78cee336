"""The ``kera`` PySpark data source against a real cluster and a real local SparkSession.

One cluster and one SparkSession serve the module (starting Spark costs
seconds; the broker-kill test starts its own cluster); stream names are
unique per test. Waits are polls with bounded deadlines; every test has a
timeout (the module's own, or the suite's 300 s).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import zlib
from collections import Counter

import pytest

pyspark = pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("kera_client.spark", reason="needs PySpark >= 4.2")

from kera_client import Admin, Consumer, Producer  # noqa: E402
from kera_client.spark import KeraDataSource, Offsets  # noqa: E402
from kera_client.spark import positions as P  # noqa: E402
from kera_client.spark.arrow import ARROW_SCHEMA, ChunkBatch  # noqa: E402
from kera_client.spark.io import align, latest, metadata, read_ranges  # noqa: E402

from kera import chunk as chunkfmt  # noqa: E402
from kera.cluster import LocalCluster  # noqa: E402

from .conftest import stream_meta  # noqa: E402


def _wait(pred, timeout: float, what: str, step: float = 0.1):
    """Poll ``pred`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(str(tmp_path_factory.mktemp("spark-cluster")), 3, port=0)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def spark():
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java (17)")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    s = (SparkSession.builder.master("local[2]").appName("kera-tests")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.session.timeZone", "UTC")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    s.dataSource.register(KeraDataSource)
    yield s
    s.stop()


def _values(stream: str, start: int, n: int) -> list[bytes]:
    return [b"%s:%07d" % (stream.encode(), i) for i in range(start, start + n)]


def _expect(streams_values: dict[str, list[bytes]]) -> dict[str, tuple[int, int]]:
    """Per stream: (count, sum of crc32 of values), Spark's crc32 being zlib's."""
    return {s: (len(v), sum(zlib.crc32(x) for x in v)) for s, v in streams_values.items()}


def _spark_counts(df) -> dict[str, tuple[int, int]]:
    from pyspark.sql import functions as F

    rows = df.groupBy("stream").agg(F.count("*").alias("n"),
                                    F.sum(F.crc32("value")).alias("crc")).collect()
    return {r["stream"]: (r["n"], r["crc"]) for r in rows}


# -- no Spark, no cluster: the pieces ---------------------------------------------------------

def test_chunks_become_one_arrow_batch_exactly():
    chunks = [
        chunkfmt.build(7, 1, 42, 0, [b"a", b"bb", b""], [b"k1", None, b"k3"], [1000, 2000, 3000]),
        chunkfmt.build(7, 1, 43, 0, [b"ccc"] * 5, None, [5] * 5),
        chunkfmt.build(9, 0, 44, 3, [bytes([i]) * i for i in range(50)]),
    ]
    batch = ChunkBatch()
    expect = []
    for j, (c, name) in enumerate(zip(chunks, ["s1", "s1", "s2"], strict=True)):
        v = chunkfmt.ChunkView(c)
        pos = P.pack(j, 64 * j)
        batch.add(name, v.header.streamlet, j, pos, c)
        for r, (k, val, ts) in enumerate(v.records()):
            expect.append({"stream": name, "streamlet": v.header.streamlet, "group": j,
                           "position": pos + r, "key": k, "value": val, "ts": ts * 1000,
                           "producer": v.header.producer_id})
    rb = batch.build()
    assert rb.schema.equals(ARROW_SCHEMA)
    got = rb.to_pydict()
    assert rb.num_rows == len(expect) == 58
    for col in ("stream", "streamlet", "group", "position", "key", "value", "producer"):
        assert got[col] == [e[col] for e in expect], col
    assert rb.column("timestamp").cast(pa.int64()).to_pylist() == [e["ts"] for e in expect]
    assert rb.column("key").null_count == 1 + 5 + 50  # empty keys are null

    one = ChunkBatch()
    v = chunkfmt.ChunkView(chunks[1])
    one.add("x", 1, 0, 0, chunks[1])
    rb1 = one.build()  # a single chunk: Arrow uses the chunk's buffers in place
    assert rb1.column("value").to_pylist() == [b"ccc"] * 5
    assert rb1.column("key").null_count == 5


def test_positions_offsets_admission_and_planning():
    DONE = P.DONE
    assert P.compact(0, {"0": DONE, "1": DONE, "2": P.pack(1, 8), "3": 0}) == (2, {2: P.pack(1, 8)})
    assert P.merge_max((0, {0: 100, 1: 5}), (1, {1: 3, 2: 9})) == (1, {1: 5, 2: 9})
    assert P.work((0, {0: 100}), (1, {1: 50})) == {0: (100, DONE), 1: (0, 50)}
    assert P.cut_points(P.pack(0, 10), P.pack(3, 5)) == [P.pack(1, 0), P.pack(2, 0), P.pack(3, 0)]
    assert P.cut_points(P.pack(0, 10), DONE) == []
    assert P.span_bytes(P.pack(0, 10), P.pack(2, 5), 100, 8) == 195
    assert P.span_bytes(P.pack(7, 40), DONE, 100, 8) == 60

    # JSON: canonical (sorted, compacted), round trips, and reads a consumer's position()
    o = Offsets({"b": 2, "a": 1}, {("b", 0): (0, {1: 5, 0: DONE}), ("a", 1): (0, {})})
    j = o.to_json()
    assert json.dumps(j) == ('{"streams": {"a": 1, "b": 2}, "positions": '
                             '{"b/0": {"low": 1, "groups": {"1": 5}}}}')
    assert Offsets.from_json(json.dumps(j)).to_json() == j
    assert Offsets.from_json({"b/0": {"low": 1, "groups": {"1": 5}}}).get("b", 0) == (1, {1: 5})
    # a stream re-created under the same name starts again at its beginning
    assert Offsets.from_json(j).rebased({"a": 1, "b": 3}).positions == {}

    # admission: 100 streams x 1 streamlet, 1 group of 3.5 segments of 1000 bytes
    meta = {f"s{i}": stream_meta(name=f"s{i}", id=i, segment_size=1000) for i in range(100)}
    start = Offsets({n: m.id for n, m in meta.items()}, {})
    top = Offsets(start.streams, {(n, 0): (0, {0: P.pack(3, 500)}) for n in meta})
    assert P.estimate_bytes(start, top, meta) == 100 * 3500
    assert P.admit(start, top, meta, float("inf")) == (top, [])
    assert P.admit(start, top, meta, 10**9) == (top, [])
    end, cuts = P.admit(start, top, meta, 50_000, turn=0, chunk_bytes=500)
    assert len(cuts) == 64, "the budget is shared by at most 64 groups"
    assert {c.target for c in cuts} == {P.pack(0, 531)}  # 50000/64 minus half a chunk
    _, cuts2 = P.admit(start, top, meta, 50_000, turn=1, chunk_bytes=500)
    assert {c.stream for c in cuts} | {c.stream for c in cuts2} == set(meta), "round-robin over turns"
    _, few = P.admit(start, top, meta, 1_000, turn=0, chunk_bytes=500)
    assert len(few) == 2, "no more cuts than chunks in the budget"
    # small backlogs go whole, the big one is cut with what is left
    mixed = Offsets(start.streams, {("s0", 0): (0, {0: P.pack(3, 500)}), ("s1", 0): (0, {0: 100}),
                                    ("s2", 0): (0, {0: 200})})
    end, cuts = P.admit(start, mixed, meta, 1_300, turn=0, chunk_bytes=100)
    assert end.get("s1", 0) == (0, {0: 100}) and end.get("s2", 0) == (0, {0: 200})
    assert [(c.stream, c.target) for c in cuts] == [("s0", P.pack(0, 950))]
    # a target is moved to a chunk boundary by the caller; without one, to a segment start
    c = cuts[0]
    assert P.apply_cuts(end, cuts, {("s0", 0, 0): P.pack(0, 990)}).get("s0", 0) == (0, {0: P.pack(0, 990)})
    assert P.apply_cuts(end, cuts, {}).get("s0", 0) == (0, {0: P.pack(1, 0)})
    assert P.aligned_or_fallback(c, P.pack(5, 0)) == P.pack(1, 0), "an answer past the end is ignored"

    # planning: sizes spread evenly, a big streamlet is split at segment starts
    rs = P.ranges(start, top, meta)
    parts = P.plan(rs, meta, partition_bytes=1 << 30, min_partitions=4, max_partitions=64)
    loads = [sum(r.nbytes for r in p) for p in parts]
    assert len(parts) == 4 and max(loads) - min(loads) <= 3500
    big = {"big": stream_meta(name="big", segment_size=1000)}
    rs = P.ranges(Offsets({"big": 1}), Offsets({"big": 1}, {("big", 0): (0, {0: P.pack(7, 900)})}), big)
    parts = P.plan(rs, big, partition_bytes=2000, min_partitions=1, max_partitions=64)
    assert len(parts) == 4
    pieces = sorted((g.start, g.end) for p in parts for r in p for g in r.groups)
    assert pieces[0][0] == 0 and pieces[-1][1] == P.pack(7, 900)
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False)), "contiguous"


# -- cluster, no Spark: reading ranges up to exact end positions ------------------------------

def test_read_stops_exactly_at_end_positions(cluster):
    coord = cluster.coordinator
    with Admin(coord) as a:
        a.create_stream("cut-a", streamlets=2, groups=2, segment_size=8192, group_segments=2)
    with Producer(coord, chunk_size=1024) as p:
        p.send_many("cut-a", _values("cut-a", 0, 3000))
        p.flush()
        meta = metadata(coord, ["cut-a"])
        mid = latest(meta)
        p.send_many("cut-a", _values("cut-a", 3000, 3000))
    meta = metadata(coord, ["cut-a"])
    end = latest(meta)
    start = Offsets(end.streams, {})
    addrs = {n: s.addrs for n, s in meta.items()}

    def read(a, b):
        wires = [r.to_wire() for r in P.ranges(a, b, meta)]
        out = []
        for rb in read_ranges(coord, wires, addrs, pull_bytes=4096, timeout=30):
            out += rb.column("value").to_pylist()
        return out

    first, second = read(start, mid), read(mid, end)
    assert sorted(first) == _values("cut-a", 0, 3000)
    assert sorted(second) == _values("cut-a", 3000, 3000)
    # groups filled and closed (8 KiB segments, 2 per group): DONE positions were crossed
    assert any(P.DONE in v[1].values() or v[0] > 0 for v in end.positions.values())
    # admitted steps (cut inside chunks' segments, aligned to chunk boundaries by the broker)
    # add up to the same records, none twice, none lost, each step close to its budget
    steps, cur, sizes = [], start, []
    for t in range(200):
        nxt, cuts = P.admit(cur, end, meta, 10_000, turn=t, chunk_bytes=1024)
        nxt = P.apply_cuts(nxt, cuts, align(meta, cuts))
        if nxt.to_json() == cur.to_json():
            break
        got = read(cur, nxt)
        steps += got
        sizes.append(len(got))
        cur = nxt
    assert sorted(steps) == _values("cut-a", 0, 6000)
    assert cur.to_json() == end.to_json()
    assert max(sizes[:-1]) * 29 < 10_000 + 2 * 1024, f"steps of {sizes} records of ~29 bytes"


# -- Spark ---------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_availablenow_ingests_200_streams_exactly(cluster, spark, tmp_path):
    coord = cluster.coordinator
    names = [f"acc-{i:03d}" for i in range(200)]
    with Admin(coord) as a:
        for n in names:
            a.create_stream(n, streamlets=2)
    sent = {n: _values(n, 0, 1000) for n in names}
    with Producer(coord, acks="all") as p:
        for n in names:
            p.send_many(n, sent[n])
        p.flush()
    out, chk = str(tmp_path / "out"), str(tmp_path / "chk")
    q = (spark.readStream.format("kera").option("coordinator", coord).option("pattern", "acc-*")
         .option("consumerGroup", "acc").option("maxRecordsPerTrigger", 80_000)
         .load().writeStream.format("parquet").option("path", out).option("checkpointLocation", chk)
         .trigger(availableNow=True).start())
    assert q.awaitTermination(120), "availableNow query did not finish"
    assert q.exception() is None
    df = spark.read.parquet(out)
    assert df.count() == 200_000
    assert df.select("stream", "value").distinct().count() == 200_000
    assert _spark_counts(df) == _expect(sent)
    # Spark commits a micro-batch's end to the source when it starts the next one: the
    # group holds the end of the last batch but one, and a consumer of it goes on from there
    with Consumer(names, coord, group="acc") as c:
        assert c.committed()
        left = sum(1 for _ in c.records(timeout=2.0))
    assert 0 < left < 200_000, left


class KeepProducing:
    """A thread that writes ``per`` records to every stream per round until stopped;
    ``sent`` counts what was acknowledged, ``errors`` holds what went wrong."""

    def __init__(self, coord, names, per):
        self.sent = {n: 0 for n in names}
        self.errors = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(coord, names, per), daemon=True)
        self.thread.start()

    def _run(self, coord, names, per):
        try:
            with Producer(coord, acks="all") as p:
                while not self.stop.is_set():
                    for n in names:
                        p.send_many(n, _values(n, self.sent[n], per))
                    p.flush()
                    for n in names:
                        self.sent[n] += per
                    self.stop.wait(0.1)  # pacing, not synchronisation
        except BaseException as e:  # surfaced by the test thread
            self.errors.append(e)

    def finish(self):
        self.stop.set()
        self.thread.join(60)
        assert not self.errors, self.errors


@pytest.mark.timeout(180)
def test_restart_from_checkpoint_while_producing_is_exactly_once(cluster, spark, tmp_path):
    coord = cluster.coordinator
    names = [f"rs-{i:02d}" for i in range(20)]
    with Admin(coord) as a:
        for n in names:
            a.create_stream(n, streamlets=2, groups=2)
    w = KeepProducing(coord, names, 200)

    out, chk = str(tmp_path / "out"), str(tmp_path / "chk")

    def start(trigger, limit=3000):
        r = spark.readStream.format("kera").option("coordinator", coord).option("pattern", "rs-*")
        if limit:
            r = r.option("maxRecordsPerTrigger", limit)
        w = (r.load()
             .writeStream.format("parquet").option("path", out).option("checkpointLocation", chk))
        return w.trigger(**trigger).start()

    def batches_with_data(q):
        return sum(1 for p in q.recentProgress if p["numInputRows"] > 0)

    try:
        _wait(lambda: sum(w.sent.values()) >= 4000, 30, "the producer to start")
        q1 = start({"processingTime": "0 seconds"})
        _wait(lambda: batches_with_data(q1) >= 3 or q1.exception(), 60, "3 micro-batches")
        print("q1", [(p["numInputRows"], p["durationMs"]) for p in q1.recentProgress])
        q1.stop()  # mid-way: the producer keeps writing
        assert q1.exception() is None
        q2 = start({"processingTime": "0 seconds"})
        _wait(lambda: batches_with_data(q2) >= 2 or q2.exception(), 60, "2 more micro-batches")
        assert q2.exception() is None
        q2.stop()
    finally:
        w.finish()
    q3 = start({"availableNow": True}, limit=None)  # the last restart drains what is left
    assert q3.awaitTermination(120)
    assert q3.exception() is None
    total = sum(w.sent.values())
    df = spark.read.parquet(out)
    assert df.count() == total, "every record exactly once"
    assert df.select("stream", "value").distinct().count() == total
    assert _spark_counts(df) == _expect({n: _values(n, 0, w.sent[n]) for n in names})


def _python_calls(fn) -> int:
    """Python function calls made on this thread while ``fn`` runs."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.timeout(120)
def test_write_hands_arrow_columns_to_send_columns(cluster):
    """The sink's write path: Arrow buffers straight to send_columns, so its Python work
    does not grow with the records (round-robin); with keys only their hashing does."""
    from kera_client.spark.source import WriteOptions, _write

    coord = cluster.coordinator
    with Admin(coord) as a:
        for n in ("w-small", "w-large", "w-keyed"):
            a.create_stream(n, streamlets=3)

    def write(stream, n, keyed=False):
        vals = pa.array([b"%s-%07d" % (stream.encode(), i) for i in range(n)], pa.binary())
        cols = [vals] if not keyed else [vals, pa.array([None if i % 4 == 0 else b"k%d" % (i % 13)
                                                          for i in range(n)], pa.binary())]
        batch = pa.record_batch(cols, names=["value", "key"][:len(cols)])
        o = WriteOptions({"coordinator": coord, "stream": stream,
                          "partitioner": "key" if keyed else "round-robin"})
        o.streamlet_count = 3
        return lambda: _write(o, [batch.slice(0, n // 2), batch.slice(n // 2)])

    small = _python_calls(write("w-small", 10_000))
    run = write("w-large", 200_000)
    t0, c0 = time.monotonic(), time.process_time()
    large = _python_calls(run)
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    print(f"send_columns write: 200,000 records in {wall:.2f} s ({200_000 / wall:,.0f} records/s, "
          f"{cpu:.2f} s CPU with profiling on); Python calls {small} (10k records) vs {large} (200k)")
    assert large < 2 * small + 200  # not per record: 20x the records
    _write_keyed = write("w-keyed", 5_000, keyed=True)
    _write_keyed()
    with Consumer(["w-large", "w-keyed"], coordinator=coord, start="earliest") as c:
        got, deadline = [], time.monotonic() + 60
        while len(got) < 205_000 and time.monotonic() < deadline:
            got += c.poll(1.0)
    assert Counter(r.stream for r in got) == {"w-large": 200_000, "w-keyed": 5_000}
    keyed = [r for r in got if r.stream == "w-keyed"]
    by_key: dict = {}
    for r in keyed:
        if r.key is not None:
            by_key.setdefault(r.key, set()).add(r.streamlet)
    assert len(by_key) == 13 and all(len(s) == 1 for s in by_key.values())  # a key: one streamlet
    assert sum(r.key is None for r in keyed) == 5_000 // 4


@pytest.mark.timeout(150)
def test_batch_read_by_pattern_offsets_and_write_back(cluster, spark):
    coord = cluster.coordinator
    with Admin(coord) as a:
        for n in ["bp-x-0", "bp-x-1", "bp-x-2", "bp-y-0", "bp-xx"]:
            a.create_stream(n, streamlets=3)
    sent = {}
    with Producer(coord, acks="all") as p:
        for n in ["bp-x-0", "bp-x-1", "bp-x-2", "bp-y-0", "bp-xx"]:
            sent[n] = _values(n, 0, 500)
            p.send_many(n, sent[n])
        for k in range(10):
            p.send("bp-x-0", b"keyed-%d" % k, key=b"k%d" % k)
        p.flush()
    sent["bp-x-0"] = sent["bp-x-0"] + [b"keyed-%d" % k for k in range(10)]
    df = spark.read.format("kera").option("coordinator", coord).option("pattern", "bp-x-*").load()
    assert [f.name for f in df.schema.fields] == ["stream", "streamlet", "group", "position", "key",
                                                   "value", "timestamp", "producer"]
    rows = df.collect()
    assert {r["stream"] for r in rows} == {"bp-x-0", "bp-x-1", "bp-x-2"}
    assert Counter(r["stream"] for r in rows) == {n: len(sent[n]) for n in ["bp-x-0", "bp-x-1", "bp-x-2"]}
    keyed = {r["value"]: r["key"] for r in rows if r["key"] is not None}
    assert keyed == {b"keyed-%d" % k: b"k%d" % k for k in range(10)}
    assert len({(r["stream"], r["streamlet"], r["group"], r["position"]) for r in rows}) == len(rows)
    now = time.time()
    assert all(abs(r["timestamp"].timestamp() - now) < 600 for r in rows)

    # explicit streams, and start/end offsets as JSON
    meta = metadata(coord, ["bp-y-0"])
    mid = latest(meta).dumps()
    with Producer(coord, acks="all") as p:
        p.send_many("bp-y-0", _values("bp-y-0", 500, 250))
    def reader():  # DataFrameReader options accumulate: a fresh one per read
        return spark.read.format("kera").option("coordinator", coord).option("streams", "bp-y-0")

    before = reader().option("endingOffsets", mid).load()
    after = reader().option("startingOffsets", mid).load()
    assert sorted(r["value"] for r in before.select("value").collect()) == _values("bp-y-0", 0, 500)
    assert sorted(r["value"] for r in after.select("value").collect()) == _values("bp-y-0", 500, 250)

    # df.write.format("kera") -> readable by the kera consumer
    (df.select("key", "value").write.format("kera").option("coordinator", coord)
     .option("stream", "bp-out").option("create", "true").option("streamlets", 2).mode("append").save())
    got = []
    with Consumer(["bp-out"], coordinator=coord, start="earliest") as c:
        deadline = time.monotonic() + 60
        while len(got) < len(rows) and time.monotonic() < deadline:
            got += [(r.key, r.value) for r in c.poll(1.0)]
    assert Counter(got) == Counter((r["key"], r["value"]) for r in rows)


@pytest.mark.timeout(150)
def test_new_stream_matching_the_pattern_is_ingested_and_written_back(cluster, spark, tmp_path):
    coord = cluster.coordinator
    with Admin(coord) as a:
        a.create_stream("late-0", streamlets=2)
    with Producer(coord, acks="all") as p:
        p.send_many("late-0", _values("late-0", 0, 1000))
    q = (spark.readStream.format("kera").option("coordinator", coord).option("pattern", "late-*")
         .load().writeStream.format("memory").queryName("late").trigger(processingTime="200 milliseconds")
         .start())
    try:
        def count(stream):
            return spark.sql(f"select count(*) from late where stream = '{stream}'").collect()[0][0]

        _wait(lambda: count("late-0") == 1000 or q.exception(), 60, "late-0 ingested")
        with Admin(coord) as a:
            a.create_stream("late-1", streamlets=3)
        with Producer(coord, acks="all") as p:
            p.send_many("late-1", _values("late-1", 0, 700))
            p.send_many("late-0", _values("late-0", 1000, 10))
        _wait(lambda: count("late-1") == 700 or q.exception(), 60, "late-1 (created later) ingested")
        _wait(lambda: count("late-0") == 1010 or q.exception(), 30, "late-0 tail ingested")
        assert q.exception() is None
        values = sorted(r[0] for r in spark.sql("select value from late").collect())
        assert values == sorted(_values("late-0", 0, 1010) + _values("late-1", 0, 700))
    finally:
        q.stop()

    # writeStream into kera (availableNow), then read back by the consumer
    w = (spark.readStream.format("kera").option("coordinator", coord).option("pattern", "late-*")
         .load().selectExpr("key", "value").writeStream.format("kera").option("coordinator", coord)
         .option("stream", "late-copy").option("create", "true")
         .option("checkpointLocation", str(tmp_path / "wchk")).trigger(availableNow=True).start())
    assert w.awaitTermination(90)
    assert w.exception() is None
    got = []
    with Consumer(["late-copy"], coordinator=coord, start="earliest") as c:
        deadline = time.monotonic() + 60
        while len(got) < 1710 and time.monotonic() < deadline:
            got += [r.value for r in c.poll(1.0)]
    assert sorted(got) == values



@pytest.mark.timeout(200)
def test_broker_killed_under_a_streaming_query_loses_and_doubles_nothing(make_cluster, spark, tmp_path):
    cluster = make_cluster(4)
    coord = cluster.coordinator
    names = [f"kill-{i:02d}" for i in range(16)]
    with Admin(coord) as a:
        for n in names:
            a.create_stream(n, streamlets=2, replication=3)
    w = KeepProducing(coord, names, 100)

    out, chk = str(tmp_path / "out"), str(tmp_path / "chk")

    def start(trigger, limit=2000):
        r = (spark.readStream.format("kera").option("coordinator", coord).option("pattern", "kill-*")
             .option("readTimeout", 60))
        if limit:
            r = r.option("maxRecordsPerTrigger", limit)
        return (r.load().writeStream.format("parquet").option("path", out)
                .option("checkpointLocation", chk).trigger(**trigger).start())

    def batches_with_data(q):
        return sum(1 for p in q.recentProgress if p["numInputRows"] > 0)

    try:
        _wait(lambda: sum(w.sent.values()) >= 3200, 30, "the producer to start")
        q = start({"processingTime": "0 seconds"})
        _wait(lambda: batches_with_data(q) >= 2 or q.exception(), 60, "2 micro-batches")
        before = batches_with_data(q)
        cluster.kill("node2-broker")
        _wait(lambda: batches_with_data(q) >= before + 3 or q.exception(), 90,
              "micro-batches after the broker died")
        assert q.exception() is None
        q.stop()
    finally:
        w.finish()
    q2 = start({"availableNow": True}, limit=None)
    assert q2.awaitTermination(120)
    assert q2.exception() is None
    df = spark.read.parquet(out)
    # what the cluster holds now, read by the kera consumer: Spark got exactly that, once
    # polled up to what was acknowledged (an empty poll is not the end; the deadline guards a
    # hang, as when records were lost), then any surplus
    held = {n: [] for n in names}
    with Consumer(names, coordinator=coord, start="earliest") as c:
        n_held, deadline = 0, time.monotonic() + 60
        while n_held < sum(w.sent.values()) and time.monotonic() < deadline:
            for r in c.poll(1.0):
                held[r.stream].append(r.value)
                n_held += 1
        for r in c.poll(0.3):
            held[r.stream].append(r.value)
    assert df.count() == sum(map(len, held.values()))
    assert df.select("stream", "value").distinct().count() == df.count(), "nothing twice"
    assert _spark_counts(df) == _expect(held), "Spark read what the consumer reads"
    lost = {n: w.sent[n] - len(held[n]) for n in names if len(held[n]) != w.sent[n]}
    if lost:
        with Admin(coord) as a:
            rec = a.status().get("recoveries")
        pytest.fail(f"acknowledged records lost by broker recovery: {lost}; recoveries: {rec}")
    assert sorted(held) == names and all(sorted(held[n]) == _values(n, 0, w.sent[n]) for n in names)


@pytest.mark.timeout(150)
def test_source_and_sink_take_the_clients_security_settings(make_cluster, spark, tmp_path):
    """With --auth, a query reads and writes as the user its options (or a client.conf named
    by the option ``config``) say, with that user's rights; with none it is refused."""
    from kera.security import client_config
    from kera.security.acl import Acl

    c = make_cluster(1, auth=True)
    admin = client_config.read(c.client_conf)
    with Admin(c.coordinator, admin) as a:
        a.create_streams(["sec-in", "sec-out"], replication=1)
        a.add_user("spark", "spark-pw")
        for op, name in (("read", "sec-in"), ("write", "sec-out")):
            a.add_acl(Acl("User:spark", "allow", op, "stream", name))
    with Producer(c.coordinator, {**admin, "acks": "all"}) as p:
        p.send_many("sec-in", _values("sec-in", 0, 300))
        p.flush()
    user = {**admin, "sasl.username": "spark", "sasl.password": "spark-pw"}
    conf = str(tmp_path / "spark.conf")
    client_config.write(conf, user)

    def read(**opts):
        return spark.read.format("kera").option("coordinator", c.coordinator).option(
            "streams", "sec-in").options(**opts).load()

    df = read(**user)
    assert sorted(r["value"] for r in df.select("value").collect()) == _values("sec-in", 0, 300)
    (read(config=conf).select("value").write.format("kera").option("coordinator", c.coordinator)
     .option("stream", "sec-out").option("config", conf).mode("append").save())
    with Consumer(["sec-out"], c.coordinator, config=admin) as co:
        got = [r.value for r in co.records(timeout=5, max_records=300)]
    assert sorted(got) == _values("sec-in", 0, 300)
    for opts in ({}, {**user, "sasl.password": "wrong"}):
        with pytest.raises(Exception, match="unauthenticated|authentication_failed|authenticate"):
            read(**opts).count()
    with pytest.raises(Exception, match="unauthorized"):   # no right to write there
        (read(**user).select("value").write.format("kera").option("coordinator", c.coordinator)
         .option("stream", "sec-in").options(**user).mode("append").save())


ACTIVE = 100_000


@pytest.mark.timeout(240)
def test_one_record_to_each_of_100k_streams_read_by_a_pattern_and_by_spark(cluster, spark):
    """100,000 new streams of one streamlet, R=3, default broker settings (the memory budget
    on): one producer sends one record to each (``send``, no preloading) and every one is
    acknowledged (a stream holding one record used to be charged a whole segment: 81,922 of
    them were refused ``broker_full``); a consumer subscribed with a pattern reads each back
    exactly once, and so does the Spark source."""
    from pyspark.sql import functions as F

    coord = cluster.coordinator
    names = [f"act-{i:06d}" for i in range(ACTIVE)]

    def value(name: str) -> bytes:
        return name.encode().ljust(100, b".")

    with Admin(coord) as a:
        for i in range(0, ACTIVE, 4096):
            a.create_streams(names[i:i + 4096], streamlets=1, replication=3)
    with Producer(coord) as p:
        for n in names:
            p.send(n, value(n))
        p.flush()   # ProduceError if any record failed
        assert p.acked == ACTIVE and p.failed == 0
    got: dict[str, bytes] = {}
    with Consumer(None, coordinator=coord, pattern="act-*", start="earliest") as c:
        deadline = time.monotonic() + 90
        while len(got) < ACTIVE and time.monotonic() < deadline:
            for ch in c.poll_chunks(1.0):
                for v in ch.values():
                    assert ch.stream not in got, f"{ch.stream} read twice"
                    got[ch.stream] = v
        assert c.poll_chunks(0.2) == []
    assert len(got) == ACTIVE and all(got[n] == value(n) for n in names), "not read back exactly"

    df = spark.read.format("kera").option("coordinator", coord).option("pattern", "act-*").load()
    row = df.agg(F.count("*").alias("n"), F.countDistinct("stream").alias("streams"),
                 F.sum((F.col("value").cast("string") != F.rpad("stream", 100, ".")).cast("int"))
                 .alias("wrong")).collect()[0]
    assert (row["n"], row["streams"], row["wrong"]) == (ACTIVE, ACTIVE, 0)
