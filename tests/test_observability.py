"""Metrics endpoints, a real Prometheus scraping a ``kera up`` cluster, and ``kera top``.

One cluster for the module (3 nodes, ``--metrics-port``), used in order: the metric list
of docs/operations.md under produce load, ``kera top`` in a pseudo-terminal, then
Prometheus (produce, consume, lag, backups killed last)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import urllib.parse
import urllib.request

import pytest

from kera.cluster import LocalCluster
from kera.process import free_ports

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "operations.md")
NODES = 3
ENDPOINTS = 1 + 2 * NODES


def until(what: str, check, timeout: float = 60.0, every: float = 0.25):
    """``check()``'s first truthy answer, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def kera(*args, stdin=None, timeout=60, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kera", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env, check=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = free_ports(ENDPOINTS)
    c = LocalCluster(str(tmp_path_factory.mktemp("obs")), NODES, metrics_port=base,
                     coordinator_args=["--dead-after", "2.0", "--metrics-lag-interval", "1"])
    c.start()
    c.env = dict(os.environ, KERA_COORDINATOR=c.coordinator)
    until("cluster ready", lambda: subprocess.run(
        [sys.executable, "-m", "kera", "status"], env=c.env, capture_output=True).returncode == 0)
    yield c
    c.stop()


def doc_metrics() -> dict[str, str]:
    """metric -> server, from docs/operations.md's metric list."""
    out = {}
    for line in open(DOC):
        m = re.match(r"\| `(kera_[a-z_]+)` \| (broker|backup|coordinator) \|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def test_every_documented_metric_is_served_under_produce_load(cluster):
    listed = doc_metrics()
    assert len(listed) >= 60, listed
    kera("stream", "create", "load", "--streamlets", "6", "--replication", "3", env=cluster.env)
    # a consumer group, so the coordinator has lag to show
    kera("produce", "load", stdin=b"x\n" * 100, env=cluster.env)
    kera("consume", "load", "--group", "g0", "--max", "10", "--count-only", env=cluster.env)
    load = subprocess.Popen([sys.executable, "-m", "kera", "produce", "load", "--generate", "3000000",
                             "--producers", "2"], env=cluster.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        addrs = cluster.metrics_addrs()
        until("produce load", lambda: b"kera_broker_records_in_total" in http_get(
            f"http://{addrs['node1-broker']}/metrics") and _records_in(cluster) > 20_000)
        until("lag measured", lambda: "kera_consumergroup_lag{" in http_get(
            f"http://{addrs['coordinator']}/metrics").decode())
        for name, addr in addrs.items():
            role = "coordinator" if name.startswith("coordinator") else name.rsplit("-", 1)[1]
            t0 = time.monotonic()
            text = http_get(f"http://{addr}/metrics").decode()
            took = time.monotonic() - t0
            assert load.poll() is None, "the load ended before every endpoint was read"
            have = families(text)
            missing = [m for m, r in listed.items() if r == role and
                       m not in have and m.removesuffix("_total") not in have]
            assert not missing, f"{name} ({addr}) lacks {missing}"
            assert took < 5, f"{name} took {took:.1f} s to answer under load"
        # bad requests get an HTTP error, the endpoint goes on serving
        with pytest.raises(urllib.error.HTTPError) as e:
            http_get(f"http://{addrs['node1-broker']}/nothing")
        assert e.value.code == 404
        with socket.create_connection(tuple(addrs["node1-backup"].split(":"))) as s:
            s.sendall(b"\x00garbage\r\n\r\n")
        assert b"kera_backup_replicas" in http_get(f"http://{addrs['node1-backup']}/metrics")
    finally:
        load.kill()
        load.wait()


def _records_in(cluster) -> int:
    total = 0
    for name, addr in cluster.metrics_addrs().items():
        if name.endswith("broker"):
            m = re.search(rb"^kera_broker_records_in_total (\S+)$",
                          http_get(f"http://{addr}/metrics"), re.M)
            total += int(float(m.group(1)))
    return total


def test_kera_top_shows_brokers_and_group_lag_and_quits_on_q(cluster):
    kera("stream", "create", "topped", "--streamlets", "2", env=cluster.env)
    kera("produce", "topped", stdin=b"r\n" * 500, env=cluster.env)
    kera("consume", "topped", "--group", "watchers", "--max", "200", "--count-only", env=cluster.env)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "kera", "top"], stdin=slave, stdout=slave,
                         stderr=slave, env=dict(cluster.env, TERM="xterm-256color"),
                         start_new_session=True)
    os.close(slave)
    seen = b""
    try:
        def screen():
            nonlocal seen
            import select
            while select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
            text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b" ", seen)
            return (b"watchers" in text and b"topped" in text and b"300" in text
                    and all(re.search(rb"\s%d\s+.{0,12}alive" % b, text) for b in (1, 2, 3)))
        until("kera top showing 3 brokers and the group's lag of 300", screen, timeout=30)
        os.write(master, b"q")
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)


@pytest.fixture(scope="module")
def prometheus_bin():
    path = shutil.which("prometheus")
    if path is None:
        r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
                           capture_output=True, text=True,
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        if r.returncode != 0:   # the package index may be missing on a fresh machine
            subprocess.run(["apt-get", "update"], capture_output=True)
            r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
                               capture_output=True, text=True,
                               env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        path = shutil.which("prometheus")
        assert path, f"Debian's prometheus package could not be installed: {r.stderr[-500:]}"
    return path


def _doc_block(after: str) -> str:
    text = open(DOC).read()
    at = text.index(after)
    return re.search(r"```yaml\n(.*?)```", text[at:], re.S).group(1)


def test_prometheus_scrapes_the_cluster(cluster, prometheus_bin, tmp_path):
    base = cluster.metrics_port
    conf = _doc_block("## Scrape configuration")
    conf = re.sub(r"127\.0\.0\.1:94(\d\d)", lambda m: f"127.0.0.1:{base + int(m.group(1))}", conf)
    conf = conf.replace("scrape_interval: 5s", "scrape_interval: 1s").replace(
        "evaluation_interval: 5s", "evaluation_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(conf)
    (tmp_path / "kera-alerts.yml").write_text(_doc_block("## Alert rules"))
    port = free_ports(1)
    prom = subprocess.Popen([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "wb"))
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(q: str) -> list:
        r = json.loads(http_get(f"{api}/query?" + urllib.parse.urlencode({"query": q})))
        assert r["status"] == "success", r
        return r["data"]["result"]

    def value(q: str) -> float | None:
        res = query(q)
        return float(res[0]["value"][1]) if res else None

    try:
        until("prometheus ready", lambda: _ok(f"http://127.0.0.1:{port}/-/ready"), timeout=60)
        rules = json.loads(http_get(f"{api}/rules"))["data"]["groups"]
        assert sorted(r["name"] for g in rules for r in g["rules"]) == [
            "KeraConsumerGroupLagGrowing", "KeraRecoveryNotFinished", "KeraUnderReplicatedVsegs"]
        until("all 7 targets up", lambda: value("sum(up)") == ENDPOINTS)
        kera("stream", "create", "prom", "--streamlets", "3", "--replication", "3", env=cluster.env)
        n = 60_000
        before = value("sum(kera_broker_records_in_total)") or 0
        t0 = time.monotonic()
        kera("produce", "prom", "--generate", str(n), "--size", "50", env=cluster.env)
        produced_in = time.monotonic() - t0
        until("records in counted", lambda: value("sum(kera_broker_records_in_total)") == before + n)
        kera("consume", "prom", "--group", "pg", "--max", "25000", "--count-only", env=cluster.env)
        # the count above is exact; the rate Prometheus derives from it is bounded by everything
        # in one second (give or take the extrapolation ``rate`` makes to a window's edges). The
        # subquery's steps fall on whole seconds up to the query's time and a sample is stamped
        # when its scrape began, so right after the count is seen no step may yet hold a sample
        # from before the produce and one from after it in its window: the rate is then none or
        # 0 (seen in CI), and shows once a step passes both, for the window's 10 s
        peak = until("the produce's rate seen", lambda: value(
            "max_over_time(sum(rate(kera_broker_records_in_total[10s]))[2m:1s])"), timeout=30)
        assert 0 < peak <= n * 1.1, (peak, produced_in)
        p99 = value('histogram_quantile(0.99, sum by (le) (rate('
                    'kera_broker_request_latency_seconds_bucket{rpc="produce"}[2m])))')
        assert p99 is not None and 0 < p99 <= 10, p99
        until("group pg's lag of 35,000", lambda: value(
            'sum(kera_consumergroup_lag{group="pg",stream="prom"})') == n - 25_000)
        assert value('sum(kera_consumergroup_committed_records{group="pg",stream="prom"})') == 25_000
        # a vseg opened by the last appends may be scraped before its copies are open
        until("no vseg under-replicated", lambda: value("sum(kera_broker_under_replicated_vsegs)") == 0)
        # R=3 keeps two backup copies beside the broker's: with two of the three backups
        # killed, no vseg can be whole on two live backups, and none can be healed
        cluster.kill("node3-backup")
        cluster.kill("node2-backup")
        until("two dead backups", lambda: value(
            'kera_coordinator_members{role="backup",state="dead"}') == 2)
        until("every vseg under-replicated", lambda: (value("sum(kera_broker_vsegs)") or 0) > 0 and value(
            "sum(kera_broker_under_replicated_vsegs)") == value("sum(kera_broker_vsegs)"))
        until("their endpoints down", lambda: value('count(up{job="kera-backup"} == 0)') == 2)
    finally:
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()


def _ok(url: str) -> bool:
    try:
        http_get(url, timeout=2)
        return True
    except OSError:
        return False
