"""Producers: records -> chunks (one per streamlet) -> requests (one per broker).

``send`` appends a record to its streamlet's open chunk; a chunk is sealed
when it reaches ``chunk.size`` or has waited ``linger.ms`` (if its streamlet
is then in a request, once that request is settled: under load chunks grow
rather than queue, as a Kafka producer's batches do); sealed chunks get
the next sequence of their (producer, streamlet) and leave in requests of up
to ``request.size`` bytes, one per broker, at most ``max.in.flight`` requests
per broker. A streamlet is in at most one request at a time, so a retry
(after a moved streamlet, a dead broker, a timeout) resends its chunks in
sequence order and the broker's sequence check drops duplicates.

Chunks the producer gives up on (delivery timeout, refused by the broker)
leave a hole in their streamlet's sequence: the first chunk sent after them
carries ``SEQ_RESET``, which the broker takes as the producer's new base.
Chunks keep the sequence they were sealed with, so one that may already sit
on the broker is never stored again under another number.

A record whose chunk could not fit min(MAX_CHUNK, the stream's segment size)
is refused by ``send`` with ``RecordTooLarge``, before anything is sent (with
a delivery callback, that error is its report instead).

Delivery reports (``on_delivery``, see ``delivery``) hook in where a record
joins its open chunk, where a sealed chunk is acknowledged and where one is
given up on; records sent without a callback carry nothing.

The producer is made of parts, each owning its state and handed what it uses:
``producer_config`` (options), ``lanes`` (a ``Route`` per stream, a ``Lane`` per
streamlet, the shared ``Buffer`` and the sender's ``Waker``), ``accumulator``
(records into chunks, linger, the lanes waiting to leave), ``lookups`` (streams'
metadata, looked up together), ``sender`` (requests, retries, give-ups),
``columnar`` (batch calls) and ``delivery`` (reports); ``AsyncProducer`` joins
them, and the synchronous ``Producer`` wraps it.
"""

from __future__ import annotations

import math
import time
from contextlib import asynccontextmanager

import trio

from kera.coordinator.link import CoordinatorLink
from kera.errors import RETRIABLE
from kera.rpc import open_pool, unwrapped
from kera.security.client_config import credentials

from .accumulator import Accumulator
from .admin import default_coordinator
from .bulk import bulk
from .columnar import Columnar
from .delivery import Deliveries, Pending
from .lanes import Buffer, Route, Waker
from .lookups import Lookups
from .portal import Portal
from .producer_config import DEFAULTS, producer_config
from .sender import ProduceError, Sender

__all__ = ["DEFAULTS", "RETRIABLE", "AsyncProducer", "ProduceError", "Producer", "open_producer"]


class AsyncProducer:
    """The trio-native producer. Use ``open_producer`` (or ``Producer`` from sync code)."""

    def __init__(self, pool, nursery, coordinator: str, cfg: dict, deliveries: Deliveries | None = None):
        self.cfg = cfg
        self.nursery = nursery
        self.delivery = deliveries or Deliveries()
        self.buffer = Buffer(int(cfg["buffer.memory"]))
        self.waker = Waker()
        self.acc = Accumulator(cfg, self.buffer, self.delivery, self.waker)
        self.lookups = Lookups(cfg, CoordinatorLink(pool, coordinator), self.buffer, self.delivery,
                               self.acc, self.waker)
        self.lookups.nursery = nursery
        self.sender = Sender(cfg, pool, self.buffer, self.delivery, self.acc, self.lookups, self.waker)
        self.columnar = Columnar(self.acc, self.lookups, self.buffer, self.delivery, self.waker)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The producer's loop (in its nursery): once it has its id, it is started."""
        await self.sender.identify()
        self.columnar.producer_id = self.sender.producer_id
        task_status.started()
        await self.sender.loop(self.nursery)

    # -- records in ----------------------------------------------------------------------------
    async def send(self, stream: str, value: bytes, key: bytes | None = None, timestamp: int | None = None,
                   on_delivery=None, report: bool = False) -> Pending | None:
        """Queue one record. ``on_delivery(error, DeliveryReport)`` is called once with its
        outcome (default: the producer's); ``report=True`` returns a ``Pending`` to await instead.
        A record to a stream not known yet waits for its lookup (``lookups``), not the caller:
        if the stream does not exist, its report (or ``flush``) says so."""
        cb = Pending() if report else on_delivery or self.delivery.default
        buf = self.buffer
        while buf.bytes >= buf.memory:
            await buf.progress.wait()
        r = self.lookups.streams.get(stream)
        with buf.lock:
            if r is None:   # looked up with the other streams met meanwhile (``lookups``)
                self.lookups.park(stream, value, key, timestamp, cb)
            else:
                self.acc.append(r, value, key, timestamp, cb)
        if self.delivery.ready:
            self.delivery.hand()
        return cb if report else None

    async def send_many(self, stream: str, values, keys=None, streamlet: int | None = None,
                        on_delivery=None, report: bool = False) -> Pending | None:
        """See ``Columnar.send_many``."""
        return await self.columnar.send_many(stream, values, keys, streamlet, on_delivery, report)

    async def send_columns(self, stream: str, value_offsets, value_data, key_offsets=None,
                           key_data=b"", timestamps=None, streamlet: int | None = None,
                           on_delivery=None, report: bool = False) -> Pending | None:
        """See ``Columnar.send_columns``."""
        return await self.columnar.send_columns(stream, value_offsets, value_data, key_offsets,
                                                key_data, timestamps, streamlet, on_delivery, report)

    async def load_metadata(self, names) -> None:
        """Fetch where many streams live up front (else they are looked up as they are met)."""
        await self.lookups.load_metadata(names)

    async def stream(self, name: str) -> Route:
        """Where the stream lives, looked up if need be (UnknownStream if it does not exist)."""
        return await self.lookups.stream(name)

    # -- settling ------------------------------------------------------------------------------
    def seal_all(self) -> None:
        """Seal every open chunk, lingering or not."""
        with self.buffer.lock:
            self.acc.seal_all()

    def kick(self) -> None:
        """Seal every open chunk, look up the streams met without waiting out the linger, and
        wake the sender (what ``flush`` starts with)."""
        self.seal_all()
        self.lookups.hurry()
        self.waker.set()

    def check(self) -> None:
        """Raise ProduceError if records failed that no delivery report told of."""
        d = self.delivery
        if d.silent:
            raise ProduceError(f"{d.silent} records failed: {'; '.join(d.silent_why[:3])}")

    async def flush(self) -> None:
        """Wait until every record sent so far is acknowledged (or failed); raises ProduceError
        for failed records sent without a delivery callback."""
        self.kick()
        while self.buffer.records > 0:
            await self.buffer.progress.wait()
        self.delivery.hand()
        self.check()

    def closed(self) -> None:
        """The producer stopped: its figures stay readable, the routes of the streams it wrote
        go (a producer that wrote to a million streams held a few objects for each)."""
        with self.buffer.lock, bulk():
            for r in self.lookups.streams.values():
                r.lanes = []   # a lane and its route refer to each other: freed now, not by a
            self.lookups.streams.clear()   # collection walking every object of the process
            self.lookups.by_id.clear()

    # -- figures -------------------------------------------------------------------------------
    @property
    def acked(self) -> int:
        return self.buffer.acked

    @property
    def failed(self) -> int:
        return self.buffer.failed

    @property
    def outstanding(self) -> int:
        """Records sent and not settled yet."""
        return self.buffer.records

    @property
    def latencies(self):
        return self.buffer.latencies

    @property
    def producer_id(self) -> int:
        return self.sender.producer_id

    @property
    def streams(self) -> dict[str, Route]:
        return self.lookups.streams

    @property
    def metadata_requests(self) -> int:
        return self.lookups.requests

    @property
    def request_size(self) -> int:
        return self.sender.request_size

    @property
    def chunk_size(self) -> int:
        return self.acc.chunk_size


@asynccontextmanager
async def open_producer(coordinator: str | None = None, config: dict | None = None, on_delivery=None, **kw):
    """``async with open_producer(acks="all", linger_ms=1) as p: await p.send("s", b"v")``;
    ``on_delivery(error, report)``: the default delivery callback of ``send``."""
    cfg = producer_config(config, kw)
    async with unwrapped(), open_pool(credentials=credentials(config)) as pool, \
            trio.open_nursery() as nursery:
        p = AsyncProducer(pool, nursery, coordinator or default_coordinator(), cfg, Deliveries(on_delivery))
        await nursery.start(p.run)
        try:
            yield p
            await p.flush()
        finally:
            nursery.cancel_scope.cancel()
            p.closed()


class Producer:
    """Synchronous producer for ordinary scripts; the network runs in a background thread.

    ``send`` never blocks on the network (only when ``buffer.memory`` is full);
    ``flush`` waits for acknowledgements. Delivery callbacks (``on_delivery``, per
    record, per batch call or producer-wide) run on the thread calling ``send``,
    ``poll`` or ``flush``, never on the network thread.
    """

    def __init__(self, coordinator: str | None = None, config: dict | None = None, on_delivery=None, **kw):
        self.portal = Portal("kera-producer")
        self._default = on_delivery
        try:
            self._p: AsyncProducer = self.portal.start(self._serve, coordinator, config, kw)
        except BaseException:
            self.portal.close()
            raise
        self._d = self._p.delivery

    async def _serve(self, coordinator, config, kw, task_status):
        cfg = producer_config(config, kw)
        async with open_pool(credentials=credentials(config)) as pool:
            p = None
            try:
                async with trio.open_nursery() as nursery:
                    p = AsyncProducer(pool, nursery, coordinator or default_coordinator(), cfg,
                                      Deliveries(self._default, queued=True))
                    await nursery.start(p.run)
                    task_status.started(p)
            finally:
                if p is not None:
                    p.closed()

    def send(self, stream: str, value: bytes, key: bytes | None = None, timestamp: int | None = None,
             on_delivery=None) -> None:
        """Queue one record; first serve any delivery reports waiting. ``on_delivery(error,
        DeliveryReport)`` (default: the producer's) is called once with the record's outcome."""
        p = self._p
        if self._d.ready:
            self._d.serve()
        cb = on_delivery or self._default
        r = p.lookups.streams.get(stream)
        buf = p.buffer
        with buf.lock:
            if buf.bytes >= buf.memory:
                buf.wait_space()
            if r is None:   # looked up with the other streams met meanwhile (``lookups``)
                p.lookups.park(stream, value, key, timestamp, cb)
            else:
                p.acc.append(r, value, key, timestamp, cb)

    def send_many(self, stream: str, values, keys=None, streamlet: int | None = None, on_delivery=None) -> None:
        """See ``AsyncProducer.send_many``; ``on_delivery(error, BatchReport)`` once for the call."""
        self.portal.call(self._p.send_many, stream, values, keys, streamlet, on_delivery)

    def send_columns(self, stream: str, value_offsets, value_data, key_offsets=None, key_data=b"",
                     timestamps=None, streamlet: int | None = None, on_delivery=None) -> None:
        """See ``AsyncProducer.send_columns``; ``on_delivery(error, BatchReport)`` once for the call."""
        self.portal.call(self._p.send_columns, stream, value_offsets, value_data, key_offsets,
                         key_data, timestamps, streamlet, on_delivery)

    def poll(self, timeout: float = 0) -> int:
        """Serve waiting delivery reports on this thread, waiting up to ``timeout`` seconds for
        one if none is waiting; returns how many callbacks were called."""
        d = self._d
        if not d.ready and timeout > 0:
            buf = self._p.buffer
            with buf.lock:
                if not d.ready:
                    buf.space.wait(timeout)
        return d.serve()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every record sent so far is acknowledged or failed, serving delivery
        reports meanwhile; trio.TooSlowError after ``timeout`` seconds. Raises ProduceError
        for failed records sent without a callback."""
        p, d = self._p, self._d

        async def kick():
            p.kick()
        self.portal.call(kick)
        end = time.monotonic() + (timeout if timeout is not None else math.inf)
        buf = p.buffer
        while True:
            d.serve()
            with buf.lock:
                if buf.records <= 0 and not d.ready:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    raise trio.TooSlowError(f"{buf.records} records not acknowledged after {timeout} s")
                if not d.ready:
                    buf.space.wait(min(left, 0.1))
        p.check()

    @property
    def acked(self) -> int:
        return self._p.acked

    @property
    def failed(self) -> int:
        return self._p.failed

    @property
    def latencies(self):
        return self._p.latencies

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.portal.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.portal.close()
