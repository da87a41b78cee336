"""kera's side of a benchmark: a local cluster, producer and consumer processes.

Producers are the paper's proxy producers: each cycles over all streams, one
``send()`` per record from Python (the same shape as the peer's one
``produce()`` per record), so each request carries a chunk per stream.
``mode="send_many"`` (a 2-D array per stream) and ``mode="send_columns"`` (offsets
and one buffer, sent in slices of ``COLUMN_SLICE`` records) use the batch API
instead, labelled separately. Workers report their own CPU time (``cpu_s``, all
threads) over the measured part.

Latency is per record, as on the peer's side: every ``LATENCY_SAMPLE_EVERY``-th
record is sent with a delivery callback, whose report gives the time from its
``send`` call to its acknowledgement (``DeliveryReport.latency``). The batch
mode reports per ``send_many`` call (call -> its last chunk acknowledged).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import tempfile
import time

import numpy as np
import trio

from kera.cluster import LocalCluster

from .peer import LATENCY_SAMPLE_EVERY
from .stage import TIME_CHECK, WARM_SECONDS_RATE, run_stage, split, summarize

BATCH_FROM = 10_000    # streams: created in create_streams batches, deleted 32 at a time
COLUMN_SLICE = 65536  # records per send_columns call: big enough to amortise the call, small
                      # enough that the first chunks leave while later slices are packed


TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """Seconds of CPU (user + system, all threads) process ``pid`` used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu() -> float:
    """Seconds of CPU this process used so far (user + system, all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def produce_worker(coord, streams, n_records, size, cfg, *, mode="send", start_index=0,
                   rate=0.0, warmup=0, seconds=0.0, barrier=None) -> dict:
    """``seconds``: send() for that long (at most ``n_records``), then flush; ``sent`` in the
    result says how many records were sent, so readers know what to expect."""
    from kera_client import Producer

    p = Producer(coord, cfg)
    try:
        p.portal.call(p._p.load_metadata, streams)
        value = b"x" * size
        s = len(streams)
        for i in range(warmup):  # not timed, not counted: connections and caches warm
            p.send(streams[i % s], value)
        p.flush()
        warm = p.acked
        latencies: list[float] = []

        def on_delivery(error, report):
            if error is None:
                latencies.append(report.latency)

        every = LATENCY_SAMPLE_EVERY
        if barrier is not None:
            barrier.wait()
        t0, c0 = time.monotonic(), own_cpu()
        if mode == "send":
            send = p.send
            if rate:
                tick = 0.001
                per_tick = max(1, int(rate * tick))
                i = 0
                while i < n_records:
                    for _ in range(min(per_tick, n_records - i)):
                        if i % every == 0:
                            send(streams[(start_index + i) % s], value, on_delivery=on_delivery)
                        else:
                            send(streams[(start_index + i) % s], value)
                        i += 1
                    wait = t0 + i / rate - time.monotonic()
                    if wait > 0:
                        p.poll()
                        time.sleep(wait)
            else:
                end = start_index + n_records
                stop = t0 + seconds if seconds else math.inf
                at = start_index
                while at < end and time.monotonic() < stop:
                    upto = min(end, at + TIME_CHECK)
                    for i in range(at, upto):
                        if i % every == 0:
                            send(streams[i % s], value, on_delivery=on_delivery)
                        else:
                            send(streams[i % s], value)
                    at = upto
                n_records = at - start_index
        elif mode == "send_many":
            per = max(1, n_records // s)
            arr = np.full((per, size), ord("x"), dtype=np.uint8)
            for j in range(s):
                p.send_many(streams[(start_index + j) % s], arr, on_delivery=on_delivery)
        elif mode == "send_columns":
            per = max(1, n_records // s)
            data = value * min(per, COLUMN_SLICE)
            for j in range(s):
                for a in range(0, per, COLUMN_SLICE):
                    m = min(COLUMN_SLICE, per - a)
                    p.send_columns(streams[(start_index + j) % s], np.arange(0, (m + 1) * size, size),
                                   data, on_delivery=on_delivery)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        p.flush()
        t1, c1 = time.monotonic(), own_cpu()
        lat = sorted(x * 1000 for x in latencies)
        return {"records": p.acked - warm, "sent": n_records, "t_start": t0, "t_end": t1, "cpu_s": c1 - c0,
                "latencies_ms": lat[:: max(1, len(lat) // 5000)]}
    finally:
        p.portal.close()


def consume_worker(coord, streams, n_records, timeout_s, *, start="earliest", skip=0, barrier=None,
                    touch=False, config=None) -> dict:
    """Reads ``n_records`` (of which the first ``skip``, the warm-up, are not reported).

    ``touch``: every record's value is taken as a bytes object and its length added up,
    the same per-record work the peer's consumer does (``len(m.value())``); without it
    records are counted from chunk headers (kera's chunk-level reading, labelled so).
    ``config``: the client's security settings."""
    from kera_client import open_consumer

    async def run():
        async with open_consumer(streams, coord, config, start=start) as c:
            if barrier is not None:
                await trio.to_thread.run_sync(barrier.wait)
            t0, c0 = time.monotonic(), own_cpu()
            n = 0
            total = 0
            with trio.move_on_after(timeout_s):
                while n < n_records:
                    for ch in await c.poll_chunks(1.0):
                        if touch:
                            for v in ch.values():
                                total += len(v)
                        n += len(ch)
            return {"records": n - skip, "t_start": t0, "t_end": time.monotonic(), "bytes": total,
                    "cpu_s": own_cpu() - c0}

    return trio.run(run)


def per_stream(sent: list[int], starts: list[int], n_streams: int) -> list[int]:
    """Records each stream got from producers that sent ``sent[j]`` records round-robin over
    all streams, producer j starting at stream ``starts[j]``."""
    per = [0] * n_streams
    for c, st in zip(sent, starts, strict=True):
        full, rem = divmod(c, n_streams)
        for t in range(n_streams):
            per[t] += full + (1 if (t - st) % n_streams < rem else 0)
    return per


class KeraRun:
    """A cluster for a series of runs (streams are created per run); ``auth``, ``tls``: its
    modes (every client then uses its admin's ``client.conf``)."""

    def __init__(self, nodes: int, broker_args=(), backup_args=(), coordinators: int = 1,
                 auth: bool = False, tls: bool = False, metrics_port: int | None = None):
        self.dir = tempfile.mkdtemp(prefix="kera-bench-")
        self.cluster = LocalCluster(os.path.join(self.dir, "data"), nodes, port=0,
                                    broker_args=list(broker_args), backup_args=list(backup_args),
                                    coordinators=coordinators, auth=auth, tls=tls,
                                    metrics_port=metrics_port)
        self.runs = 0
        self.idle_s = 0.0   # how long the last ``delete`` waited for the servers to go idle
        self.security: dict = {}

    def __enter__(self):
        from kera.security import client_config

        self.cluster.start()
        if self.cluster.auth or self.cluster.tls:
            self.security = client_config.read(self.cluster.client_conf)
        return self

    def __exit__(self, *exc):
        self.cluster.stop()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    def create(self, n_streams, streamlets=1, groups=1, replication=1, vlogs=None) -> list[str]:
        return trio.run(self.acreate, n_streams, streamlets, groups, replication, vlogs)

    async def acreate(self, n_streams, streamlets=1, groups=1, replication=1, vlogs=None) -> list[str]:
        """Fresh streams for one run, created 32 at a time (``create_streams`` batches past
        ``BATCH_FROM``)."""
        from kera_client import open_admin

        self.runs += 1
        names = [f"b{self.runs}-{i:04d}" for i in range(n_streams)]
        limit = trio.CapacityLimiter(32)
        async with open_admin(self.cluster.coordinator, self.security) as a:
            if n_streams >= BATCH_FROM:
                for i in range(0, n_streams, 4096):
                    await a.create_streams(names[i:i + 4096], streamlets=streamlets, groups=groups,
                                           replication=replication, vlogs=vlogs)
                return names
            async def one(n):
                async with limit:
                    await a.create_stream(n, streamlets=streamlets, groups=groups,
                                          replication=replication, vlogs=vlogs)
            async with trio.open_nursery() as nursery:
                for n in names:
                    nursery.start_soon(one, n)
        return names

    def stats(self) -> dict:
        """Replicate RPCs (each carrying a broker's copies for one backup), chunks appended,
        records and bytes produced, summed over the brokers' own counters."""
        from kera_client import open_admin

        async def go():
            async with open_admin(self.cluster.coordinator, self.security) as a:
                st = await a.broker_stats()
            return {"rpcs": sum(r.get("replication", {}).get("rpcs", 0) for r in st),
                    "chunks": sum(v["appended"] for r in st for v in r["vlogs"]),
                    "records_in": sum(r.get("records_in", 0) for r in st),
                    "bytes_in": sum(r.get("bytes_in", 0) for r in st)}

        return trio.run(go)

    def pids(self, kind: str) -> list[int]:
        """The cluster's processes of one kind (broker, backup, coordinator)."""
        return [p.pid for name, p in self.cluster.procs.items() if name.split("-")[-1].rstrip("0123456789") == kind]

    def server_cpu(self) -> dict:
        """CPU seconds used so far, summed per kind of server process."""
        return {kind: sum(proc_cpu(x) for x in self.pids(kind)) for kind in ("coordinator", "broker", "backup")}

    def delete(self, streams) -> None:
        """Drop a run's streams, so the next run meets a cluster as fresh as the peer's."""
        from kera_client import open_admin

        async def go():
            limit = trio.CapacityLimiter(1 if len(streams) < BATCH_FROM else 32)
            async with open_admin(self.cluster.coordinator, self.security) as a, trio.open_nursery() as nursery:
                async def one(n):
                    async with limit:
                        await a.delete_stream(n)
                for n in streams:
                    nursery.start_soon(one, n)

        trio.run(go)
        self.idle()

    def idle(self, window: float = 0.5, busy: float = 0.1, max_s: float = 120.0) -> float:
        """Wait until the cluster's servers are idle (together under ``busy`` of a core over
        ``window`` seconds), at most ``max_s``; returns the seconds waited. After a run's
        streams are deleted the brokers and the coordinator drop them in the background (at
        100,000 streams, 10-20 s of CPU; an idle cluster holding 100,000 streams uses ~4% of a
        core): the next run must measure its own work, not that."""
        t0 = time.monotonic()
        last = sum(self.server_cpu().values())
        while time.monotonic() - t0 < max_s:
            time.sleep(window)
            now = sum(self.server_cpu().values())
            if now - last < busy * window:
                break
            last = now
        self.idle_s = round(time.monotonic() - t0, 2)
        return self.idle_s

    def measure(self, streams, n_records, size, producers, consumers, cfg, *, mode="send",
                rate=0.0, warmup=0.05, timeout_s=300.0, sequential=False, touch=False,
                chunk_read=False, seconds=0.0) -> dict:
        """``sequential``: consumers start once the producers are done (reading alone);
        ``chunk_read`` then reads the same records again counting chunk headers only
        (``consume_rps_chunks``). ``seconds`` (sequential send() runs only): each producer
        sends for that long, at most its share of ``n_records``; the readers then read what
        was sent."""
        if seconds and not (sequential and mode == "send" and not rate):
            raise ValueError("a timed run is a sequential send() run at full speed")
        coord = self.cluster.coordinator
        ctx = multiprocessing.get_context("spawn")
        if mode != "send":
            n_warm = 0
        else:  # not timed, not counted: connections and caches warm
            n_warm = max(len(streams), int(WARM_SECONDS_RATE * seconds if seconds else n_records * warmup))
            n_warm //= producers
        before, cpu0 = self.stats(), self.server_cpu()
        counts = split(n_records, producers)
        starts = [(j * len(streams)) // producers for j in range(producers)]
        jobs = [("p", j, produce_worker, (coord, streams, counts[j], size, {**cfg, **self.security}),
                 {"mode": mode, "start_index": starts[j], "rate": rate, "warmup": n_warm,
                  "seconds": seconds})
                for j in range(producers)]
        groups = [streams[k::consumers] for k in range(consumers)]

        def cjobs(sent: list[int]) -> tuple[list, int]:
            """Readers of ``sent`` records per producer (each cycled over every stream from
            its start; its warm-up, read first, is not reported)."""
            if mode == "send":  # exact shares per stream: records cycle over the streams
                per = per_stream(sent, starts, len(streams))
                share = [sum(per[k::consumers]) for k in range(consumers)]
            else:
                share = [sum((c // len(streams)) for c in sent) * len(g) for g in groups]
            warm = per_stream([n_warm] * producers, [0] * producers, len(streams))
            wshare = [sum(warm[k::consumers]) for k in range(consumers)]
            return [("c", k, consume_worker, (coord, groups[k], share[k] + wshare[k], timeout_s),
                     {"skip": wshare[k], "touch": touch, "config": self.security})
                    for k in range(consumers)], sum(share)

        settled: dict = {}   # how long the machine took to quiet down before the clock started
        if sequential:
            outs = run_stage(ctx, jobs, timeout_s + 60, settled)
            counts = [outs[("p", j)]["sent"] for j in range(producers)]
            readers, expected = cjobs(counts)
            if readers:
                outs.update(run_stage(ctx, readers, timeout_s + 60))
        else:
            readers, expected = cjobs(counts)
            outs = run_stage(ctx, jobs + readers, timeout_s + 60, settled)
        chunk_rps = None
        if sequential and chunk_read and readers:
            again = run_stage(ctx, [(kind, k, fn, args, {**kw, "touch": False})
                                    for kind, k, fn, args, kw in readers], timeout_s + 60)
            c2 = list(again.values())
            chunk_rps = round(sum(o["records"] for o in c2) /
                              (max(o["t_end"] for o in c2) - min(o["t_start"] for o in c2)))
        after, cpu1 = self.stats(), self.server_cpu()
        couts = [outs[("c", k)] for k in range(consumers)]
        pouts = [outs[("p", j)] for j in range(producers)]
        cpu = {"producers": sum(o["cpu_s"] for o in pouts), "consumers": sum(o["cpu_s"] for o in couts),
               **{k + "s": cpu1[k] - cpu0[k] for k in cpu0}}
        out = summarize(pouts, couts,
                        min(o["t_start"] for o in couts) if sequential and couts else None)
        out.update(rpcs=after["rpcs"] - before["rpcs"], chunks=after["chunks"] - before["chunks"],
                   bytes_in=after["bytes_in"] - before["bytes_in"],
                   records_in=after["records_in"] - before["records_in"])
        if consumers:
            out["expected"] = expected
        out["chunks_per_rpc"] = round(out["chunks"] / out["rpcs"], 1) if out["rpcs"] else None
        out["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
        out["quiet"] = settled
        out["cpu_us_per_record"] = {k: round(v / sum(counts) * 1e6, 2) for k, v in cpu.items()}
        if chunk_rps is not None:
            out["consume_rps_chunks"] = chunk_rps
        return out

