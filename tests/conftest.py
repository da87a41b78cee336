"""Real clusters for tests: processes on 127.0.0.1, random ports, temp dirs."""

from __future__ import annotations

import pytest

from kera.cluster import LocalCluster


@pytest.fixture
def make_cluster(tmp_path):
    """``make_cluster(nodes=3, broker_args=[...])`` starts a cluster, stopped at teardown."""
    started = []

    def make(nodes: int = 3, **kw) -> LocalCluster:
        kw.setdefault("coordinator_args", ["--dead-after", "2.0"])
        c = LocalCluster(str(tmp_path / f"cluster{len(started)}"), nodes, port=0, **kw)
        started.append(c)
        c.start()
        return c

    yield make
    for c in started:
        c.stop()
