"""Real clusters for tests: processes on 127.0.0.1, random ports, temp dirs."""

from __future__ import annotations

import socket

import pytest

from kera.cluster import LocalCluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
