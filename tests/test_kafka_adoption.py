"""Kafka offsets across an adoption: a broker whose settled history was evicted to its
backups is killed with -9 while a librdkafka producer writes; the recovery re-points that
history at the backups' copies (adoption, not replay), and the new owner indexes the adopted
chunks' Kafka offsets from the index rows: a consumer reads every acknowledged record at the
offset it was acknowledged with, dense, and new records follow the highest offset."""

from __future__ import annotations

import threading
import time

import pytest
import trio
from kera_client import open_admin

from tests.kafka_helpers import kafka_cluster

pytestmark = [pytest.mark.xdist_group("kafka-adoption"), pytest.mark.timeout(420)]

MiB = 1 << 20
BEFORE = 120_000      # records written before the kill (~26 MiB: most of it evicted)
DURING = 30_000       # written around the kill
PAD = bytes(200)


def _admin(cluster, fn):
    async def main():
        async with open_admin(cluster.coordinator) as a:
            return await fn(a)
    return trio.run(main)


def _wait(cluster, fn, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        got = _admin(cluster, fn)
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _produce(p, start: int, n: int) -> None:
    for i in range(start, start + n):
        while True:
            try:
                p.produce("h", value=b"%08d" % i + PAD, partition=0)
                break
            except BufferError:
                p.poll(0.01)


def _read_all(bs: str, n: int, timeout: float = 120) -> list[tuple[int, bytes]]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bs, "group.id": "adopted", "enable.auto.commit": False})
    c.assign([TopicPartition("h", 0, OFFSET_BEGINNING)])
    got: list = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            got += [(m.offset(), m.value()[:8]) for m in c.consume(10000, 0.5) if not m.error()]
        return got
    finally:
        c.close()


def test_kafka_offsets_survive_the_adoption_of_a_killed_brokers_history(tmp_path):
    from confluent_kafka import Producer
    cluster = kafka_cluster(tmp_path, 3, broker_args=["--memory", str(8 * MiB), "--vseg-size", str(MiB)])
    try:
        bs = cluster.kafka_bootstrap()
        s = _admin(cluster, lambda a: a.create_stream("h", streamlets=1, replication=3,
                                                      segment_size=256 << 10, group_segments=4))
        victim = next(name for name, addr in cluster.addrs.items() if addr == s.addrs[0])
        acked, errors = [], []
        p = Producer({"bootstrap.servers": bs, "enable.idempotence": True, "acks": "all",
                      "linger.ms": 5, "batch.size": 16384,
                      "on_delivery": lambda e, m: errors.append(e) if e
                      else acked.append((m.offset(), m.value()[:8]))})
        _produce(p, 0, BEFORE)
        assert p.flush(120) == 0 and not errors, errors[:3]

        async def evicted(a):
            stats = await a.broker_stats(streams=True)
            mine = [b for b in stats if b["streams"]]
            return mine and mine[0]["evicted_bytes"] >= 12 * MiB
        _wait(cluster, evicted, "the owner to evict most of its history", 60)
        dead = _admin(cluster, lambda a: a.status())
        dead = next(b["id"] for b in dead["brokers"] if b["addr"] == s.addrs[0])

        killed = threading.Event()

        def kill_mid_produce():
            while len(acked) < BEFORE + DURING // 4:
                time.sleep(0.005)
            cluster.kill(victim)
            killed.set()

        t = threading.Thread(target=kill_mid_produce)
        t.start()
        _produce(p, BEFORE, DURING)
        left = p.flush(240)   # the producer finishes on its own across the recovery
        t.join()
        assert killed.is_set() and left == 0 and not errors, errors[:3]

        async def recovered(a):
            st = await a.status()
            return [r for r in st["recoveries"] if r["broker"] == dead and r["state"] == "done"]
        rec = _wait(cluster, recovered, "the recovery of the killed broker", 90)[0]
        assert rec["adopted_segments"] > 0 and not rec["lost"], rec   # history adopted, not replayed

        total = BEFORE + DURING
        got = _read_all(bs, total)
        assert [o for o, _ in got] == list(range(len(got)))   # dense, from 0
        assert len(got) == total and {v for _, v in got} == {b"%08d" % i for i in range(total)}
        assert set(acked) <= set(got)   # each acknowledged record at the offset it was given

        more = []
        q = Producer({"bootstrap.servers": bs, "enable.idempotence": True, "acks": "all",
                      "on_delivery": lambda e, m: more.append(m.offset() if not e else e)})
        for i in range(100):
            q.produce("h", value=b"after-%d" % i, partition=0)
        assert q.flush(60) == 0
        assert more == list(range(total, total + 100))   # after the highest offset: none reused
    finally:
        cluster.stop()
