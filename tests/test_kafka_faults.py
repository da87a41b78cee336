"""Kafka clients across failures: kill -9 of a broker mid idempotent produce, then of the
whole cluster, restarted on its data dirs."""

from __future__ import annotations

import threading
import time

import pytest

from tests.kafka_helpers import kafka_cluster

pytestmark = [pytest.mark.xdist_group("kafka-faults"), pytest.mark.timeout(600)]

N = 100_000
P = 8


def _lag(c, topic: str) -> dict:
    from confluent_kafka import TopicPartition
    out = {}
    for tp in c.committed([TopicPartition(topic, i) for i in range(P)], timeout=30):
        out[tp.partition] = (tp.offset, c.get_watermark_offsets(tp, timeout=30)[1])
    return out


def _read(bs: str, group: str, n: int, timeout: float = 120) -> dict:
    from confluent_kafka import Consumer
    c = Consumer({"bootstrap.servers": bs, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe(["f"])
    got: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while sum(map(len, got.values())) < n and time.monotonic() < deadline:
            for m in c.consume(10000, 0.5):
                if not m.error():
                    got.setdefault(m.partition(), []).append((m.offset(), m.value()))
        end = time.monotonic() + 2   # nothing more comes (no duplicate)
        while time.monotonic() < end:
            for m in c.consume(10000, 0.2):
                if not m.error():
                    got.setdefault(m.partition(), []).append((m.offset(), m.value()))
        c.commit(asynchronous=False)
        return got
    finally:
        c.close()


def test_kill_a_broker_mid_idempotent_produce_then_the_whole_cluster(tmp_path):
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic
    cluster = kafka_cluster(tmp_path, 2)   # R=2: the killed broker leads half the partitions
    try:
        bs = cluster.kafka_bootstrap()
        a = AdminClient({"bootstrap.servers": bs})
        for f in a.create_topics([NewTopic("f", P, 2)]).values():
            f.result(30)
        md = a.list_topics("f", timeout=10)
        leaders = [p.leader for p in md.topics["f"].partitions.values()]
        port = {b.id: b.port for b in md.brokers.values()}
        victim = max(set(leaders), key=leaders.count)
        assert leaders.count(victim) == P // 2
        name = f"node{port[victim] - cluster.kafka_port + 1}-broker"

        acked, errors = [], []
        p = Producer({"bootstrap.servers": bs, "enable.idempotence": True, "acks": "all",
                      "linger.ms": 5, "on_delivery": lambda e, m: errors.append(e) if e
                      else acked.append((m.partition(), m.offset(), m.value()))})
        killed = threading.Event()

        def kill_when_a_third_is_acked():
            while len(acked) < N // 3:
                time.sleep(0.005)
            cluster.kill(name)
            killed.set()

        t = threading.Thread(target=kill_when_a_third_is_acked)
        t.start()
        for i in range(N):
            while True:
                try:
                    p.produce("f", value=b"r-%d" % i, key=b"k-%d" % (i % 997))
                    break
                except BufferError:
                    p.poll(0.01)
        left = p.flush(240)   # the producer finishes on its own: no application retry
        t.join()
        assert killed.is_set() and left == 0 and not errors, errors[:3]
        assert len(acked) == N

        got = _read(bs, "fg", N)
        values = [v for rows in got.values() for _, v in rows]
        assert len(values) == N and set(values) == {b"r-%d" % i for i in range(N)}   # exactly once
        assert all([o for o, _ in rows] == list(range(len(rows))) for rows in got.values())
        stored = {(pt, o, v) for pt, rows in got.items() for o, v in rows}
        assert {r for r in acked if r[1] >= 0} <= stored   # each acknowledged at the offset it got
        assert sum(1 for r in acked if r[1] < 0) == 0
        c = Consumer({"bootstrap.servers": bs, "group.id": "fg"})
        before = _lag(c, "f")
        c.close()
        assert all(committed == high for committed, high in before.values())   # lag 0

        cluster.kill_all()   # every process, kill -9; restarted on the same data dirs
        cluster.start()
        c = Consumer({"bootstrap.servers": bs, "group.id": "fg"})
        deadline = time.monotonic() + 90
        while True:
            try:
                after = _lag(c, "f")
                if after == before or time.monotonic() > deadline:
                    break
            except Exception:   # noqa: BLE001 (the brokers are still recovering)
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)
        c.close()
        assert after == before   # committed offsets and lag survive the kill and the restart
        p = Producer({"bootstrap.servers": bs, "enable.idempotence": True, "acks": "all"})
        for i in range(20):
            p.produce("f", value=b"after-%d" % i)
        assert p.flush(60) == 0
        more = _read(bs, "fg", 20)
        assert sorted(v for rows in more.values() for _, v in rows) == sorted(b"after-%d" % i for i in range(20))
    finally:
        cluster.stop()


def test_sasl_scram_users_and_acls(tmp_path):
    from confluent_kafka import Consumer, Producer

    from kera.security import client_config
    cluster = kafka_cluster(tmp_path, 1, auth=True)
    try:
        bs = cluster.kafka_bootstrap()
        conf = client_config.read(cluster.client_conf)   # the admin's SCRAM-SHA-256 settings
        p = Producer({"bootstrap.servers": bs, **conf})
        for i in range(100):
            p.produce("sa", value=b"x%d" % i)
        assert p.flush(30) == 0
        c = Consumer({"bootstrap.servers": bs, "group.id": "sg", "auto.offset.reset": "earliest", **conf})
        c.subscribe(["sa"])
        n, deadline = 0, time.monotonic() + 30
        while n < 100 and time.monotonic() < deadline:
            n += sum(1 for m in c.consume(100, 0.5) if not m.error())
        c.close()
        assert n == 100
        for bad in ({**conf, "sasl.password": "wrong"}, {}):   # a wrong password; no login at all
            failed = []
            q = Producer({"bootstrap.servers": bs, "message.timeout.ms": 3000, **bad,
                          "on_delivery": lambda e, m, failed=failed: failed.append(e)})
            q.produce("sa", value=b"no")
            q.flush(10)
            assert len(failed) == 1 and failed[0] is not None
    finally:
        cluster.stop()
