"""Real clusters for tests: processes on 127.0.0.1, random ports, temp dirs."""

from __future__ import annotations

import pytest

from kera.cluster import LocalCluster
from kera.process import free_ports
from kera.stream_meta import StreamMeta


def free_port() -> int:
    return free_ports(1)


def stream_meta(**fields) -> StreamMeta:
    """A stream's metadata for a broker part run in the test process: one streamlet on
    broker 1, ``fields`` override."""
    shape = {"name": "s", "id": 1, "streamlets": 1, "groups": 1, "replication": 1,
             "segment_size": 1 << 20, "group_segments": 8}
    shape.update(fields)
    shape.setdefault("owners", ((1, 1),) * shape["streamlets"])
    return StreamMeta(**shape)


@pytest.fixture
def make_cluster(tmp_path):
    """``make_cluster(nodes=3, broker_args=[...])`` starts a cluster, stopped at teardown.

    ``port=free_port()`` gives the coordinator a fixed port, so it can be restarted there."""
    started = []

    def make(nodes: int = 3, **kw) -> LocalCluster:
        kw.setdefault("coordinator_args", ["--dead-after", "2.0"])
        kw.setdefault("port", 0)
        c = LocalCluster(str(tmp_path / f"cluster{len(started)}"), nodes, **kw)
        started.append(c)
        c.start()
        return c

    yield make
    for c in started:
        c.stop()
