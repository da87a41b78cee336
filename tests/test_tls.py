"""Clusters run with ``--tls`` (and ``--auth --tls``): every listener, client and internal,
speaks TLS with ``kera up``'s local CA. Produce, consume, a broker's recovery and
``kera status`` work; a plaintext client and a client trusting another CA are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio
from kera_client import open_admin, open_consumer, open_producer

from kera.errors import Unavailable
from kera.security import client_config, tls

from .test_retention import wait_recovered
from .workload import read_values

pytestmark = pytest.mark.timeout(240)


def status_cli(c) -> subprocess.CompletedProcess:
    env = {**os.environ, "KERA_COORDINATOR": c.coordinator, "KERA_CONFIG": c.client_conf}
    return subprocess.run([sys.executable, "-m", "kera", "status"], capture_output=True, text=True,
                          env=env, timeout=60)


async def test_tls_only(make_cluster):
    c = make_cluster(1, tls=True)
    conf = client_config.read(c.client_conf)
    assert conf["security.protocol"] == "SSL" and os.path.exists(conf["ssl.ca.location"])
    async with open_admin(c.coordinator, conf) as a:
        await a.create_stream("t1", replication=1)
    async with open_producer(c.coordinator, conf) as p:
        for i in range(100):
            await p.send("t1", b"%d" % i)
    async with open_consumer(["t1"], c.coordinator, conf) as co:
        assert len(await read_values(co, 100)) == 100
    r = status_cli(c)
    assert r.returncode == 0 and "broker 1" in r.stdout, r.stderr
    with pytest.raises(Unavailable, match="TLS only"):   # plaintext: told, in plaintext
        async with open_admin(c.coordinator, {"security.protocol": "PLAINTEXT"}) as a:
            await a.list_streams()


async def test_auth_and_tls_produce_consume_recover(make_cluster, tmp_path, monkeypatch):
    c = make_cluster(3, auth=True, tls=True)
    monkeypatch.setenv("KERA_CONFIG", c.client_conf)   # the helpers' clients read it
    conf = client_config.read(c.client_conf)
    assert conf["security.protocol"] == "SASL_SSL"
    async with open_admin(c.coordinator, conf) as a:
        s = await a.create_stream("t3", streamlets=3, replication=3)
    n = 6000
    async with open_producer(c.coordinator, conf) as p:
        for i in range(n):
            await p.send("t3", b"%06d" % i)
        await p.flush()
        assert p.acked == n
    async with open_consumer(["t3"], c.coordinator, conf) as co:
        assert sorted(await read_values(co, n)) == [b"%06d" % i for i in range(n)]
    assert status_cli(c).returncode == 0
    other = tls.local_ca(str(tmp_path / "other-ca"))["ca"]
    for bad, why in (({**conf, "security.protocol": "SASL_PLAINTEXT"}, "TLS only"),
                     ({**conf, "ssl.ca.location": other}, "certificate verify failed")):
        with pytest.raises(Unavailable, match=why):
            async with open_admin(c.coordinator, bad) as a:
                await a.list_streams()
    victim = next(name for name, addr in c.addrs.items() if addr == s.addrs[0])
    c.kill(victim)
    with trio.fail_after(120):
        await wait_recovered(c, s, timeout=90)
    async with open_consumer(["t3"], c.coordinator, conf) as co:
        assert sorted(await read_values(co, n)) == [b"%06d" % i for i in range(n)]
    r = status_cli(c)
    assert r.returncode == 0 and "DEAD" in r.stdout, r.stderr
