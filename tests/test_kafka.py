"""Kafka clients against a `kera up` cluster with Kafka listeners (one cluster for the module).

librdkafka (confluent-kafka), kafka-python, aiokafka and Debian's kcat each write 100,000
records over 8 partitions and read them back exactly: in order per partition, dense
offsets from 0, keys, values and timestamps.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import trio

from tests.kafka_helpers import consume, kafka_cluster, kcat, produce

pytestmark = [pytest.mark.xdist_group("kafka"), pytest.mark.timeout(600)]

N = 100_000
P = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = kafka_cluster(tmp_path_factory.mktemp("kafka"), 3)
    yield c
    c.stop()


def _admin(bs):
    from confluent_kafka.admin import AdminClient
    return AdminClient({"bootstrap.servers": bs})


def _create(bs, name, partitions=P, rf=3, **configs):
    from confluent_kafka.admin import NewTopic
    a = _admin(bs)   # kept until the futures are done: a destroyed handle fails them
    for f in a.create_topics([NewTopic(name, partitions, rf, config=configs)]).values():
        f.result(30)


def _dense(got: dict) -> bool:
    return all([o for o, *_ in rows] == list(range(len(rows))) for rows in got.values())


def test_librdkafka_idempotent_producer_group_and_admin(cluster):
    from confluent_kafka import Consumer, TopicPartition
    bs = cluster.kafka_bootstrap()
    _create(bs, "lk")
    acked = produce(bs, "lk", N, P, **{"enable.idempotence": True, "acks": "all"})
    assert sum(map(len, acked.values())) == N and _dense(acked)
    got = consume(bs, ["lk"], N, **{"group.id": "g-lk"})
    assert got == acked   # per partition: same order, offsets, keys, values, timestamps
    c = Consumer({"bootstrap.servers": bs, "group.id": "g-lk"})
    committed = c.committed([TopicPartition("lk", i) for i in range(P)], timeout=10)
    for tp in committed:
        low, high = c.get_watermark_offsets(tp, timeout=10)
        assert (low, tp.offset, high) == (0, len(acked[tp.partition]), len(acked[tp.partition]))  # lag 0
    c.close()
    a = _admin(bs)
    assert len(a.list_topics(timeout=10).topics["lk"].partitions) == P
    for f in a.delete_topics(["lk"]).values():
        f.result(30)
    deadline = time.monotonic() + 30
    while "lk" in a.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "lk" not in a.list_topics(timeout=10).topics


def test_kcat_lists_produces_and_consumes(cluster):
    bs = cluster.kafka_bootstrap()
    _create(bs, "kc")
    k = kcat()
    listing = subprocess.run([k, "-L", "-b", bs], capture_output=True, text=True, timeout=30).stdout
    assert 'topic "kc" with 8 partitions' in listing
    lines = "".join(f"key-{i}:value-{i}\n" for i in range(N))
    subprocess.run([k, "-P", "-b", bs, "-t", "kc", "-K:", "-X", "linger.ms=5"], input=lines, text=True,
                   check=True, timeout=120)
    out = subprocess.run([k, "-C", "-b", bs, "-t", "kc", "-o", "beginning", "-e", "-q",
                          "-f", "%p %o %k %s\n"], capture_output=True, text=True, timeout=120).stdout
    rows = [line.split(" ") for line in out.splitlines()]
    assert len(rows) == N
    assert sorted(r[3] for r in rows) == sorted(f"value-{i}" for i in range(N))
    assert all(r[3] == "value-" + r[2][4:] for r in rows)
    by_part: dict = {}
    for p, o, _, v in rows:
        by_part.setdefault(p, []).append(int(o))
    assert len(by_part) == P and all(offs == list(range(len(offs))) for offs in by_part.values())
    for offs in by_part.values():   # kcat's partitioner keeps a key's records in order
        assert offs == sorted(offs)


def test_kafka_python_round_trip(cluster):
    from kafka import KafkaConsumer, KafkaProducer
    bs = cluster.kafka_bootstrap()
    _create(bs, "kp")
    p = KafkaProducer(bootstrap_servers=bs.split(","), acks="all", linger_ms=5, batch_size=65536)
    for i in range(N):
        p.send("kp", key=b"k%d" % i, value=b"v%d" % i, partition=i % P, timestamp_ms=1_700_000_000_000 + i)
    p.flush()
    p.close()
    c = KafkaConsumer("kp", bootstrap_servers=bs.split(","), group_id="g-kp",
                      auto_offset_reset="earliest", consumer_timeout_ms=5000, max_poll_records=10000)
    got: dict = {}
    for m in c:
        got.setdefault(m.partition, []).append((m.offset, m.key, m.value, m.timestamp))
        if sum(map(len, got.values())) == N:
            break
    c.commit()
    c.close()
    assert _dense(got) and sum(map(len, got.values())) == N
    for part, rows in got.items():
        assert [r[1] for r in rows] == [b"k%d" % i for i in range(part, N, P)]
        assert [r[3] for r in rows] == [1_700_000_000_000 + i for i in range(part, N, P)]


def test_aiokafka_idempotent_round_trip(cluster):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    bs = cluster.kafka_bootstrap()
    _create(bs, "ak")

    async def main():
        p = AIOKafkaProducer(bootstrap_servers=bs, enable_idempotence=True, linger_ms=5,
                             max_batch_size=65536)
        await p.start()
        try:
            futs = [await p.send("ak", key=b"k%d" % i, value=b"v%d" % i, partition=i % P,
                                 timestamp_ms=1_700_000_000_000 + i) for i in range(N)]
            await asyncio.gather(*futs)
        finally:
            await p.stop()
        c = AIOKafkaConsumer("ak", bootstrap_servers=bs, group_id="g-ak", auto_offset_reset="earliest")
        await c.start()
        got: dict = {}
        try:
            while sum(map(len, got.values())) < N:
                batch = await asyncio.wait_for(c.getmany(timeout_ms=1000, max_records=10000), 30)
                for tp, ms in batch.items():
                    got.setdefault(tp.partition, []).extend((m.offset, m.key, m.value, m.timestamp) for m in ms)
            await c.commit()
        finally:
            await c.stop()
        return got

    got = asyncio.run(asyncio.wait_for(main(), 300))
    assert _dense(got) and sum(map(len, got.values())) == N
    for part, rows in got.items():
        assert [r[2] for r in rows] == [b"v%d" % i for i in range(part, N, P)]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compressed_batches_are_read_by_both_consumers(cluster, codec):
    from kera_client import open_consumer
    bs = cluster.kafka_bootstrap()
    topic = f"z-{codec}"
    _create(bs, topic, 2)
    acked = produce(bs, topic, 5000, 2, **{"compression.type": codec})
    assert consume(bs, [topic], 5000, **{"group.id": f"g-{topic}"}) == acked

    async def kera_read():
        out: dict = {}
        async with open_consumer([topic], cluster.coordinator, start="earliest") as c:
            with trio.fail_after(60):
                while sum(map(len, out.values())) < 5000:
                    for r in await c.poll():
                        out.setdefault(r.streamlet, []).append((r.key, r.value, r.timestamp))
        return out

    mine = trio.run(kera_read)
    assert {p: [(k, v, t) for _, k, v, t in rows] for p, rows in acked.items()} == mine


def test_kera_records_reach_kafka_consumers_and_back(cluster):
    from kera_client import open_admin, open_consumer, open_producer
    bs = cluster.kafka_bootstrap()
    coord = cluster.coordinator
    keys = [b"k%d" % i if i % 3 else None for i in range(3000)]
    sent = {(keys[i], b"kera-%d" % i, 1_600_000_000_000 + i) for i in range(3000)}

    async def kera_side():
        async with open_admin(coord) as a:
            await a.create_stream("cross", streamlets=2)
        async with open_producer(coord) as p:
            for i in range(3000):
                await p.send("cross", b"kera-%d" % i, key=keys[i], timestamp=1_600_000_000_000 + i)
            await p.flush()

    trio.run(kera_side)
    got = consume(bs, ["cross"], 3000, **{"group.id": "g-cross"})
    assert _dense(got)
    assert {(k, v, t) for rows in got.values() for _, k, v, t in rows} == sent
    for rows in got.values():   # one producer: its records in order in each partition
        seq = [int(v[5:]) for _, _, v, _ in rows]
        assert seq == sorted(seq)
    start = {p: len(rows) for p, rows in got.items()}
    acked = produce(bs, "cross", 1000, 2)   # Kafka's records follow kera's, offsets go on
    assert {p: rows[0][0] for p, rows in acked.items()} == start

    async def kera_read():
        out = []
        async with open_consumer(["cross"], coord, start="earliest") as c:
            with trio.fail_after(60):
                while len(out) < 4000:
                    out += [(r.streamlet, r.key, r.value, r.timestamp) for r in await c.poll()]
        return out

    mine = trio.run(kera_read)
    for part in (0, 1):
        theirs = [(k, v, t) for _, k, v, t in acked[part]]
        assert [(k, v, t) for s, k, v, t in mine if s == part and v.startswith(b"v-")] == theirs
