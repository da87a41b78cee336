"""Helpers of the Kafka tests: a cluster with Kafka listeners, kcat, produce and read back."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from kera.cluster import LocalCluster
from kera.process import free_ports


def kafka_cluster(path, nodes: int = 3, **kw) -> LocalCluster:
    kw.setdefault("coordinator_args", ["--dead-after", "2.0"])
    c = LocalCluster(str(path), nodes, port=0, kafka_port=free_ports(nodes), **kw)
    c.start()
    return c


def kcat() -> str:
    """Debian's kcat, installed if missing (fails loudly if it cannot be)."""
    path = shutil.which("kcat")
    if path is None:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "kcat"],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:   # the package index may be missing on a fresh machine
            subprocess.run(["apt-get", "update"], capture_output=True)
            r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "kcat"],
                               capture_output=True, text=True, env=env)
        path = shutil.which("kcat")
        assert path, f"Debian's kcat package could not be installed: {r.stderr[-500:]}"
    return path


def produce(bs: str, topic: str, n: int, partitions: int, **conf) -> dict:
    """``n`` keyed records with timestamps through a librdkafka producer: per partition the
    (offset, key, value, timestamp) acknowledged, in order."""
    from confluent_kafka import Producer
    acked: dict[int, list] = {}
    errors = []

    def done(err, m):
        if err:
            errors.append(err)
        else:
            acked.setdefault(m.partition(), []).append((m.offset(), m.key(), m.value(), m.timestamp()[1]))

    p = Producer({"bootstrap.servers": bs, "linger.ms": 5, "on_delivery": done, **conf})
    t0 = 1_700_000_000_000
    for i in range(n):
        while True:
            try:
                p.produce(topic, value=b"v-%d" % i, key=b"key-%d" % (i % 1000), partition=i % partitions,
                          timestamp=t0 + i)
                break
            except BufferError:
                p.poll(0.01)
    assert p.flush(120) == 0
    assert not errors, errors[:3]
    return acked


def consume(bs: str, topics: list[str], n: int, timeout: float = 120, **conf) -> dict:
    """Read ``n`` records with a librdkafka consumer: per partition (offset, key, value, ts)."""
    from confluent_kafka import Consumer
    c = Consumer({"bootstrap.servers": bs, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, **conf})
    c.subscribe(topics)
    got: dict[int, list] = {}
    count, deadline = 0, time.monotonic() + timeout
    try:
        while count < n and time.monotonic() < deadline:
            for m in c.consume(10000, 0.5):
                if m.error():
                    continue
                got.setdefault(m.partition(), []).append((m.offset(), m.key(), m.value(), m.timestamp()[1]))
                count += 1
        if conf.get("group.id"):
            c.commit(asynchronous=False)
    finally:
        c.close()
    return got
