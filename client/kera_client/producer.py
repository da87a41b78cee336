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

The producer is made of: ``producer_config`` (options), ``accumulator`` (records
into chunks, linger), ``columnar`` (batch calls), ``lookups`` (streams' metadata,
looked up together), ``sender`` (requests, retries, give-ups) and ``delivery``
(reports); this module joins them into ``AsyncProducer`` and wraps that in the
synchronous ``Producer``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from contextlib import asynccontextmanager

import trio

from kera.coordinator.link import CoordinatorLink
from kera.rpc import open_pool, unwrapped
from kera.security.client_config import credentials

from .accumulator import Accumulator
from .admin import default_coordinator
from .columnar import Columnar
from .delivery import Deliveries
from .lookups import Lookups
from .portal import Portal
from .producer_config import DEFAULTS, producer_config
from .sender import RETRIABLE, ProduceError, Sender

__all__ = ["DEFAULTS", "RETRIABLE", "AsyncProducer", "ProduceError", "Producer", "open_producer"]


class AsyncProducer(Accumulator, Columnar, Lookups, Sender):
    """The trio-native producer. Use ``open_producer`` (or ``Producer`` from sync code)."""

    def __init__(self, pool, nursery, coordinator: str, cfg: dict, deliveries: Deliveries | None = None):
        self.pool = pool
        self.nursery = nursery
        self.coordinator = CoordinatorLink(pool, coordinator)
        self.cfg = cfg
        self.producer_id = 0
        self.producer_token = b""   # issued with the id: proves it is ours to the brokers
        # shared by the accumulating side (any thread) and the sender (the loop), under lock
        self.ready: dict[tuple, deque] = {}    # streamlet -> sealed chunks, in sequence order
        self.buffered = 0        # bytes counted against buffer.memory
        self.outstanding = 0     # records not yet acknowledged nor failed
        self.delivery = deliveries or Deliveries()
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)
        self._wake = trio.Event()       # the sender's next round
        self._progress = trio.Event()   # set (and replaced) when a request's answer is settled
        Accumulator.__init__(self, cfg)
        Lookups.__init__(self)
        Sender.__init__(self, cfg)


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
            async with trio.open_nursery() as nursery:
                p = AsyncProducer(pool, nursery, coordinator or default_coordinator(), cfg,
                                  Deliveries(self._default, queued=True))
                await nursery.start(p.run)
                task_status.started(p)

    def send(self, stream: str, value: bytes, key: bytes | None = None, timestamp: int | None = None,
             on_delivery=None) -> None:
        """Queue one record; first serve any delivery reports waiting. ``on_delivery(error,
        DeliveryReport)`` (default: the producer's) is called once with the record's outcome."""
        p = self._p
        if self._d.ready:
            self._d.serve()
        cb = on_delivery or self._default
        s = p.streams.get(stream)
        with p.lock:
            if p.buffered >= p.buffer_memory:
                p._wait_space()
            if s is None:   # looked up with the other streams met meanwhile (``lookups``)
                p._park(stream, value, key, timestamp, cb)
            else:
                p._append(s, value, key, timestamp, cb)

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
            p = self._p
            with p.lock:
                if not d.ready:
                    p.space.wait(timeout)
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
        while True:
            d.serve()
            with p.lock:
                if p.outstanding <= 0 and not d.ready:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    raise trio.TooSlowError(f"{p.outstanding} records not acknowledged after {timeout} s")
                if not d.ready:
                    p.space.wait(min(left, 0.1))
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
