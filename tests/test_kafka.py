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
    for p, o, _, _v in rows:
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


# -- bad input ------------------------------------------------------------------------------
def _call(sock, key: int, version: int, cid: int, body=None, raw: bytes | None = None):
    """Send one request (kio-encoded ``body`` or ``raw`` bytes after the header); the
    response entity, or None if the broker closed the connection."""
    import io
    import struct

    from kio.schema.request_header.v1.header import RequestHeader as H1
    from kio.schema.request_header.v2.header import RequestHeader as H2
    from kio.serial import entity_writer

    from kera.kafka import versions
    known = versions.supported(key, version) or key == 18
    flexible = versions.flexible(key, version) if versions.supported(key, version) else key == 18
    buf = io.BytesIO()
    h = (H2 if flexible else H1)(request_api_key=key, request_api_version=version, correlation_id=cid,
                                 client_id="t")
    entity_writer(type(h))(buf, h)
    if body is not None:
        entity_writer(type(body))(buf, body)
    buf.write(raw or b"")
    data = buf.getvalue()
    sock.sendall(struct.pack(">i", len(data)) + data)
    head = _recv(sock, 4)
    if head is None:
        return None
    frame = _recv(sock, struct.unpack(">i", head)[0])
    assert struct.unpack_from(">i", frame)[0] == cid
    if not known:
        return frame
    v = version if versions.supported(key, version) else 0
    at = 5 if versions.flexible_response_header(key, v) else 4
    return versions.reader(versions.response_class(key, v))(frame, at)[0]


def _recv(sock, n: int):
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            return None
        out += got
    return out


def _sock(addr: str):
    import socket
    host, _, port = addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def test_bad_requests_get_kafkas_answers_and_nothing_changes(cluster):
    from confluent_kafka import Consumer, TopicPartition
    from kio.schema.errors import ErrorCode

    from kera.kafka import versions
    bs = cluster.kafka_bootstrap()
    _create(bs, "bad", 3)
    acked = produce(bs, "bad", 300, 3)
    c = Consumer({"bootstrap.servers": bs, "group.id": "g-bad"})
    marks = lambda: [c.get_watermark_offsets(TopicPartition("bad", i), timeout=10) for i in range(3)]  # noqa: E731
    before = marks()
    md = c.list_topics("bad", timeout=10)
    leaders = {i: p.leader for i, p in md.topics["bad"].partitions.items()}
    addrs = {b.id: f"{b.host}:{b.port}" for b in md.brokers.values()}
    lead, other = leaders[0], next(b for b in addrs if b != leaders[0])

    s = _sock(addrs[lead])   # a size no request has: the connection is dropped
    s.sendall(b"\xff\xff\xff\xf0" + b"x" * 64)
    assert _recv(s, 4) is None
    s = _sock(addrs[lead])   # an API no broker knows
    assert _call(s, 999, 0, 1, raw=b"") is None
    s = _sock(addrs[lead])   # a version out of range
    assert _call(s, 0, 2, 2, raw=b"\x00" * 20) is None
    s = _sock(addrs[lead])   # ApiVersions of a version to come: UNSUPPORTED_VERSION, the versions
    r = _call(s, 18, 99, 3, raw=b"")
    assert r.error_code == ErrorCode.unsupported_version and any(k.api_key == 0 for k in r.api_keys)
    s = _sock(addrs[lead])   # a body that does not parse
    assert _call(s, 0, 9, 4, raw=b"\x01\x02") is None

    s = _sock(addrs[other])  # a produce to a partition this broker does not lead
    req = versions.make(versions.request_class(0, 9), acks=-1, timeout=5000, topic_data=[
        {"name": "bad", "partition_data": [{"index": 0, "records": b"\x00" * 70}]}])
    r = _call(s, 0, 9, 5, req)
    assert r.responses[0].partition_responses[0].error_code == ErrorCode.not_leader_or_follower
    s = _sock(addrs[lead])   # a batch whose CRC is wrong
    r = _call(s, 0, 9, 6, req)
    assert r.responses[0].partition_responses[0].error_code == ErrorCode.corrupt_message
    end = before[0][1]       # a fetch past the log end
    req = versions.make(versions.request_class(1, 12), replica_id=-1, max_wait=0, min_bytes=1,
                        max_bytes=1 << 20, session_epoch=-1, topics=[
                            {"topic": "bad", "partitions": [{"partition": 0, "fetch_offset": end + 10,
                                                             "partition_max_bytes": 1 << 20}]}])
    r = _call(s, 1, 12, 7, req)
    p = r.responses[0].partitions[0]
    assert p.error_code == ErrorCode.offset_out_of_range and p.high_watermark == end
    r = _call(s, 18, 3, 8, versions.make(versions.request_class(18, 3), client_software_name="t",
                                         client_software_version="1"))
    assert r.error_code == ErrorCode.none   # that connection serves on

    assert marks() == before
    assert consume(bs, ["bad"], 300, **{"group.id": "g-bad2"}) == acked
    c.close()


def test_list_offsets_by_time_and_topic_configs(cluster):
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import ConfigResource
    bs = cluster.kafka_bootstrap()
    _create(bs, "lo", 1, **{"retention.ms": "3600000", "cleanup.policy": "delete"})
    produce(bs, "lo", 1000, 1)   # timestamps 1_700_000_000_000 + i
    c = Consumer({"bootstrap.servers": bs, "group.id": "g-lo"})
    for ts, want in ((1_700_000_000_000 + 123, 123), (0, 0), (1_800_000_000_000, -1)):
        assert c.offsets_for_times([TopicPartition("lo", 0, ts)], timeout=10)[0].offset == want
    assert c.get_watermark_offsets(TopicPartition("lo", 0), timeout=10) == (0, 1000)
    c.close()
    a = _admin(bs)
    r = list(a.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, "lo")]).values())[0].result(30)
    assert r["retention.ms"].value == "3600000" and r["cleanup.policy"].value == "delete"


def test_requests_past_the_answer_limit_in_one_read_are_all_answered(cluster):
    """More requests than a connection may have answers waiting (``KAFKA_INFLIGHT``) in one
    read: once the answers at the limit are written, the rest of the read is handled too,
    not left in the buffer until the client sends again (a client that waits for their
    answers, as librdkafka does once it sent all it had, would stall until its timeout)."""
    import struct

    from kera.limits import KAFKA_INFLIGHT
    n = KAFKA_INFLIGHT + 300
    s = _sock(cluster.kafka_bootstrap().split(",")[0])
    s.settimeout(20)
    for burst in range(3):
        # ApiVersions v0 (header v1, null client id): 14 bytes each, the burst in one segment
        data = b"".join(struct.pack(">ihhih", 10, 18, 0, burst * n + i, -1) for i in range(n))
        s.sendall(data)
        for i in range(n):
            head = _recv(s, 4)
            assert head is not None, f"burst {burst}: the connection closed after {i} answers"
            frame = _recv(s, struct.unpack(">i", head)[0])
            assert struct.unpack_from(">i", frame)[0] == burst * n + i
    s.close()
