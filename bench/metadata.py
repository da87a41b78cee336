"""The metadata plane at 100,000 streams, kera (embedded log and etcd) beside the peer.

    python -m bench metadata [--quick]

For each kera metadata store (the embedded log; etcd with 3 coordinators), on 3
nodes: create streams of 1 streamlet, R=3, in ``create_streams`` batches up to
1k, 10k and 100k (``--quick``: 10k), recording the create rate of each step
while a probe asks a one-name ``metadata`` question every 20 ms (the slowest
answer says whether metadata writes stall the coordinator); the brokers' RSS
(VmRSS) before and after, per idle stream; list them all through pages; then
10,000 NEW streams: one producer writes one record to each (timed from its
first call, metadata fetch included, to flush complete, every record acked)
and one consumer reads them all (timed from open to the last record).

The peer (Tansu, memory storage, no replication) creates topics with
``AdminClient.create_topics`` (bench.peer's helper, 256 a request) up to 1k and
10k only (also with ``--quick``): its rate falls as topics grow (~250/s past 1k
here), so 100k would take the better part of an hour. Its fan-out is measured on the 10k topics just
created (never written to), one librdkafka producer from construction to flush
complete, and one consumer from construction to the last record.
"""

from __future__ import annotations

import time

import trio
from kera_client import open_admin, open_consumer, open_producer

from kera.coordinator.link import CoordinatorLink
from kera.rpc import open_pool

from .kera_side import KeraRun

VALUE = b"x" * 100


def broker_rss_kib(cluster) -> int:
    """Sum of the broker processes' VmRSS."""
    total = 0
    for name, p in cluster.procs.items():
        if name.endswith("-broker"):
            with open(f"/proc/{p.pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return total


def rates(points: list[tuple[int, float]], marks: list[int]) -> list[dict]:
    """Create rate up to each mark, and within the step from the previous mark."""
    at = dict(points)
    out, prev_n, prev_t = [], 0, 0.0
    for m in marks:
        t = at[m]
        out.append({"streams": m, "seconds": round(t, 3), "per_s": round(m / t, 1),
                    "step_per_s": round((m - prev_n) / (t - prev_t), 1)})
        prev_n, prev_t = m, t
    return out


async def kera_side(k: KeraRun, marks: list[int], fanout: int) -> dict:
    coord = k.cluster.coordinator
    names = [f"m{i:06d}" for i in range(marks[-1])]
    probes: list[float] = []
    points: list[tuple[int, float]] = []
    rss0 = broker_rss_kib(k.cluster)

    async def probe(link, done: trio.Event):
        while not done.is_set():
            t = time.monotonic()
            await link.call("metadata", {"names": [names[0]]}, timeout=30)
            probes.append(time.monotonic() - t)
            with trio.move_on_after(0.02):
                await done.wait()

    async with open_admin(coord) as a, open_pool() as pool:
        done = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(probe, CoordinatorLink(pool, coord), done)
            t0 = time.monotonic()
            made = 0
            for m in marks:   # batches end exactly at each mark
                await a.create_streams(names[made:m], streamlets=1, replication=3)
                made = m
                points.append((m, time.monotonic() - t0))
            done.set()
        rss1 = broker_rss_kib(k.cluster)
        t = time.monotonic()
        listed = len(await a.list_streams())
        list_s = time.monotonic() - t
        fan = [f"f{i:05d}" for i in range(fanout)]
        await a.create_streams(fan, streamlets=1, replication=3)

    t0 = time.monotonic()
    async with open_producer(coord, **{"linger.ms": 5}) as prod:
        await prod.load_metadata(fan)
        for s in fan:
            await prod.send(s, VALUE)
        await prod.flush()
        acked = prod.acked
    fan_s = time.monotonic() - t0
    t0 = time.monotonic()
    got = 0
    async with open_consumer(fan, coord) as c:
        with trio.move_on_after(120):
            while got < fanout:
                got += sum(len(ch) for ch in await c.poll_chunks(1.0))
    consume_s = time.monotonic() - t0
    probes.sort()
    return {"create": rates(points, marks), "listed": listed, "list_s": round(list_s, 3),
            "rss_before_kib": rss0, "rss_after_kib": rss1,
            "rss_kib_per_stream": round((rss1 - rss0) / marks[-1], 3),
            "probe_p50_ms": round(1000 * probes[len(probes) // 2], 2),
            "probe_max_ms": round(1000 * probes[-1], 2), "probes": len(probes),
            "fanout_streams": fanout, "fanout_acked": acked, "fanout_s": round(fan_s, 3),
            "consumed": got, "consume_s": round(consume_s, 3)}


def peer_side(marks: list[int], fanout: int) -> dict:
    from confluent_kafka import Producer

    from .peer import _QUIET, consume_worker, create_topics, tansu_broker

    topics = [f"t{i:06d}" for i in range(marks[-1])]
    points = []
    with tansu_broker() as bootstrap:
        t0 = time.monotonic()
        made = 0
        for m in marks:
            create_topics(bootstrap, topics[made:m], timeout_s=3600)
            made = m
            points.append((m, time.monotonic() - t0))
        fan = topics[-fanout:]   # never written to yet
        delivered = 0

        def on_delivery(err, msg):
            nonlocal delivered
            delivered += err is None

        t0 = time.monotonic()
        p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all",
                      "on_delivery": on_delivery, **_QUIET})
        for t in fan:
            while True:
                try:
                    p.produce(t, VALUE)
                    break
                except BufferError:
                    p.poll(0.005)
        p.flush(120)
        fan_s = time.monotonic() - t0
        t0 = time.monotonic()
        c = consume_worker(bootstrap, fan, len(fan), 120)
        consume_s = time.monotonic() - t0
    return {"create": rates(points, marks), "fanout_streams": len(fan), "fanout_acked": delivered,
            "fanout_s": round(fan_s, 3), "consumed": c["records"], "consume_s": round(consume_s, 3)}


def run(args, say) -> dict:
    marks = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    fanout = 5_000 if args.quick else 10_000
    rows = []
    for store, coordinators in (("embedded", 1), ("etcd", 3)):
        say(f"metadata: kera ({store} store), {args.nodes} nodes, up to {marks[-1]} streams, R=3")
        with KeraRun(args.nodes, coordinators=coordinators) as k:
            out = trio.run(kera_side, k, marks, fanout)
        rows.append({"system": f"kera R=3 ({store})", **out})
        say(f"   {out}")
    peer_marks = [1_000, 10_000]
    say(f"metadata: peer, topics up to {peer_marks[-1]}")
    out = peer_side(peer_marks, fanout)
    rows.append({"system": "peer (no replication)", **out})
    say(f"   {out}")
    for r in rows:   # flat figures for the table: the rate at each mark, the overall one
        for c in r["create"]:
            r[f"create_per_s@{c['streams']}"] = c["per_s"]
    peer_top = rows[-1]["create"][-1]
    for r in rows[:-1]:
        top = next(c for c in r["create"] if c["streams"] == peer_top["streams"])
        r["create_rate_vs_peer"] = round(top["per_s"] / peer_top["per_s"], 1)
        r["create_rate_at_max_vs_peer"] = round(r["create"][-1]["per_s"] / peer_top["per_s"], 1)
    return {"experiment": "metadata", "nodes": args.nodes, "marks": marks, "peer_marks": peer_marks,
            "fanout": fanout, "rows": rows,
            "notes": "create_rate_vs_peer: kera's and the peer's overall create rates at the same "
                     "count (the peer's largest); create_rate_at_max_vs_peer: kera's at its largest "
                     "count over the peer's at its own; the peer's fan-out uses the topics it just "
                     "created (never written to)"}
