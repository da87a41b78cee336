"""Prometheus metrics: an HTTP endpoint beside each server's RPC listener.

Each server given ``--metrics-port`` gets a ``prometheus_client`` registry of its own
whose collectors read the counters the server already keeps (its ``stats``, the
same numbers ``kera status`` shows) when scraped, so nothing is counted twice and
no work is done per record. Only request latencies and fsync and metadata-commit
durations are observed as they happen, once per request or round, into histograms.

The endpoint is served from the server's own trio loop (``serve``), not from
``prometheus_client``'s thread: the collectors then read the server's state between
two steps of the loop, never while a handler is half-way through changing it (a
thread would iterate dicts the loop is resizing), and need no lock. A scrape costs
the loop what building a few hundred lines of text costs; connections are few,
bounded and timed out.
"""

from __future__ import annotations

import inspect
import logging
from functools import partial
from time import perf_counter

import h11
import trio
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .. import limits
from ..rpc import Later

log = logging.getLogger("kera.metrics")
disable_created_metrics()   # no ``_created`` series: they double a scrape and no query here uses them

# request and round durations: from a fraction of a millisecond (a produce on loopback) to
# seconds (a stalled replication, a recovery step)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
MAX_CONNECTIONS = 16      # scrapers at once; more wait in the listen backlog
IDLE_TIMEOUT = 30.0       # seconds a kept-alive scrape connection may stay silent


class Metrics:
    """One server's registry, its request-latency histogram and where it is served."""

    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(f"kera_{role}_request_latency_seconds",
                                 "Time from a request's arrival to its answer, per RPC",
                                 ["rpc"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.addr = ""

    def histogram(self, name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(f"kera_{self.role}_{name}", doc, registry=self.registry, buckets=buckets)

    def time_rpcs(self, service) -> None:
        """Every ``rpc_*`` handler of ``service`` timed into ``latency`` (instance attributes
        in front of the class's methods: the transport is untouched)."""
        for name in dir(type(service)):
            if name.startswith("rpc_"):
                setattr(service, name, _timed(getattr(service, name),
                                              self.latency.labels(name[4:]).observe))

    def text(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        self.addr = f"{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{bound}"
        print(f"metrics on http://{self.addr}/metrics", flush=True)
        task_status.started(bound)
        slots = trio.Semaphore(MAX_CONNECTIONS)
        await trio.serve_listeners(partial(self._connection, slots), listeners)

    async def _connection(self, slots: trio.Semaphore, stream: trio.SocketStream) -> None:
        async with slots:
            try:
                await self._http(stream)
            except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass   # a broken or garbled scrape ends its own connection only
            finally:
                with trio.move_on_after(1) as cs:
                    cs.shield = True
                    await stream.aclose()

    async def _http(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.METRICS_REQUEST)
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                with trio.move_on_after(IDLE_TIMEOUT):
                    conn.receive_data(await stream.receive_some(limits.METRICS_REQUEST))
                    continue
                return
            if isinstance(ev, h11.ConnectionClosed) or ev is h11.PAUSED:
                return
            if isinstance(ev, h11.Request):
                status, body, ctype = self._answer(ev)
                headers = [("content-type", ctype), ("content-length", str(len(body)))]
                for out in (h11.Response(status_code=status, headers=headers), h11.Data(data=body),
                            h11.EndOfMessage()):
                    await stream.send_all(conn.send(out))
            elif isinstance(ev, h11.EndOfMessage):
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()

    def _answer(self, req: h11.Request) -> tuple[int, bytes, str]:
        path = req.target.split(b"?", 1)[0]
        if req.method not in (b"GET", b"HEAD"):
            return 405, b"only GET\n", "text/plain"
        if path not in (b"/metrics", b"/"):
            return 404, b"the metrics are at /metrics\n", "text/plain"
        return 200, self.text(), CONTENT_TYPE_LATEST


def _timed(fn, observe):
    """``fn`` with the time to its answer observed: at once for a plain answer, when settled
    for a ``Later``, when done for a coroutine."""

    def call(*args):
        t0 = perf_counter()
        try:
            res = fn(*args)
        except BaseException:
            observe(perf_counter() - t0)
            raise
        if type(res) is Later:
            later = Later()

            def settled(result):
                observe(perf_counter() - t0)
                later.done(result)
            res._bind(settled)
            return later
        if inspect.iscoroutine(res):
            return _finish(res, t0, observe)
        observe(perf_counter() - t0)
        return res
    return call


async def _finish(coro, t0: float, observe):
    try:
        return await coro
    finally:
        observe(perf_counter() - t0)
