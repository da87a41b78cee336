"""Delivery reports: each record's (or batch's) outcome, told once, to whoever asked.

A record sent with a callback carries ``(index in its chunk, callback, send
time, key, value)`` in its open chunk; records without one carry nothing, so
the fast path of ``send`` pays a single ``is None`` test. When a sealed chunk
is acknowledged or given up on, the producer hands the chunk to ``settle``
(per chunk, on the sender's loop, under the producer's lock); the per-record
reports are built only when served:

- the synchronous ``Producer`` queues them and serves them on the thread that
  calls ``send``, ``poll`` or ``flush`` (as confluent-kafka does), so a
  callback never runs on the network thread and may itself call ``send``;
- the ``AsyncProducer`` serves them on its trio loop once the lock is
  released; ``Pending`` turns a report into something to ``await``.

Latency is measured when the acknowledgement is processed, not when the report
is served, so it stays exact however late ``poll`` is called.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import trio

from kera.errors import DeliveryTimeout, KeraError, from_wire

log = logging.getLogger("kera.producer")

TIMEOUT = "delivery timeout"  # the producer's reason for chunks past delivery.timeout.ms


class DeliveryReport(NamedTuple):
    """One record's outcome (a named tuple: cheap to make, one per record). ``group``, ``segment`` and ``offset`` place its chunk (the
    offset in bytes inside the segment, as in the chunk header) and ``index`` is the
    record's place in that chunk; they are None when the record failed, or when the
    broker acknowledged a resent chunk it already held (its first answer was lost).
    ``latency``: seconds from ``send`` to the acknowledgement (or the failure)."""

    stream: str
    streamlet: int
    key: bytes | None
    value: bytes
    latency: float
    group: int | None = None
    segment: int | None = None
    offset: int | None = None
    index: int | None = None


@dataclass(frozen=True, slots=True)
class BatchReport:
    """One ``send_many``/``send_columns`` call's outcome: how many of its ``records`` were
    ``acked`` and ``failed``; ``chunks`` lists (streamlet, group, segment, offset, records)
    of each acknowledged chunk (group/segment/offset None as in DeliveryReport);
    ``latency``: seconds from the call to its last chunk's outcome."""

    stream: str
    records: int
    acked: int
    failed: int
    chunks: list
    latency: float


class BatchWaiter:
    """A batch call's chunks, counted down as they settle; reported once the call has
    queued all of them (``close``) and the last one is settled."""

    __slots__ = ("cb", "stream", "t0", "chunks", "pending", "queued", "acked", "failed", "error", "closed",
                 "t_end")

    def __init__(self, cb, stream: str):
        self.cb, self.stream, self.t0 = cb, stream, time.monotonic()
        self.chunks: list = []
        self.pending = self.queued = self.acked = self.failed = 0   # queued: records
        self.error: KeraError | None = None
        self.closed = False
        self.t_end = self.t0

    def report(self):
        return self.cb, self.error, BatchReport(self.stream, self.acked + self.failed, self.acked,
                                                self.failed, self.chunks, self.t_end - self.t0)


def error_for(why: str) -> KeraError:
    """The typed error of a reason the producer gave up for (a broker's error code or TIMEOUT)."""
    if why == TIMEOUT:
        return DeliveryTimeout("not acknowledged within delivery.timeout.ms")
    return from_wire({"code": why, "message": f"chunk refused: {why}"})


class Deliveries:
    """Settled chunks waiting to be reported, and where their reports are served.

    ``queued``: reports wait in a deque for ``serve`` (called by the synchronous
    producer's caller); otherwise ``hand`` calls them right away, on the loop."""

    def __init__(self, default=None, queued: bool = False):
        self.default = default       # the producer-wide callback of records sent without one
        self.queued = queued
        self.ready: deque = deque()  # (entries or waiter, stream, streamlet, error, position, t)
        self.used = default is not None  # any callback ever given: positions are asked for
        self.silent = 0              # failed records nobody was told of (flush raises for them)
        self.silent_why: list[str] = []

    # -- hooks of the producer (loop thread, producer lock held) ---------------------------
    def settle(self, c, stream: str, error: KeraError | str | None, position=None) -> None:
        """Chunk ``c`` (with ``c.reports`` set) was acknowledged (``error`` None, at
        ``position`` (group, segment, offset) when known) or given up on."""
        why = error
        if isinstance(error, str):
            error = error_for(error)
        now = time.monotonic()
        w = c.reports
        if isinstance(w, BatchWaiter):
            w.pending -= 1
            w.t_end = now
            if error is None:
                w.acked += c.records
                g, s, o = position or (None, None, None)
                w.chunks.append((c.lane.index, g, s, o, c.records))
            else:
                w.failed += c.records
                w.error = w.error or error
            if w.closed and w.pending == 0:
                self.ready.append((w, None, None, None, None, now))
            return
        if error is not None and c.records > len(w):  # some of its records have no callback
            self._silent(c.records - len(w), why if isinstance(why, str) else error.code)
        self.ready.append((w, stream, c.lane.index, error, position, now))

    def refused(self, stream: str, key, value, cb, error: KeraError) -> None:
        """A record refused before it joined a chunk (too large, unknown stream)."""
        now = time.monotonic()
        self.ready.append(([(None, cb, now, key, value)], stream, None, error, None, now))

    def failed_silently(self, c, why: str) -> None:
        """A chunk without reports was given up on: counted for ``flush``."""
        self._silent(c.records, why)

    def lost(self, records: int, why: str) -> None:
        """Records without reports failed before they joined a chunk: counted for ``flush``."""
        self._silent(records, why)

    def _silent(self, records: int, why: str) -> None:
        self.silent += records
        if len(self.silent_why) < 100:
            self.silent_why.append(why)

    def close(self, w: BatchWaiter) -> None:
        """All of a batch call's chunks are queued (producer lock held)."""
        w.closed = True
        if w.pending == 0:
            self.ready.append((w, None, None, None, None, w.t_end))

    # -- serving ----------------------------------------------------------------------------
    @staticmethod
    def _reports(item) -> list:
        """(callback, error, report) of one settled chunk or batch call (a list: built already)."""
        if type(item) is list:
            return item
        w, stream, streamlet, error, pos, t = item
        if isinstance(w, BatchWaiter):
            return [w.report()]
        new = tuple.__new__
        if pos is None:
            return [(cb, error, new(DeliveryReport, (stream, streamlet, key, value, t - t0,
                                                     None, None, None, None)))
                    for _, cb, t0, key, value in w]
        g, s, o = pos
        return [(cb, error, new(DeliveryReport, (stream, streamlet, key, value, t - t0, g, s, o, index)))
                for index, cb, t0, key, value in w]

    def serve(self) -> int:
        """Call the waiting callbacks, on this thread; returns how many were called. An
        exception from a callback propagates; the reports after it stay queued."""
        n = 0
        ready = self.ready
        while ready:
            reports = self._reports(ready.popleft())
            for j, (cb, error, report) in enumerate(reports):
                n += 1
                try:
                    cb(error, report)
                except BaseException:
                    if j + 1 < len(reports):
                        ready.appendleft(reports[j + 1:])
                    raise
        return n

    def hand(self) -> None:
        """After the lock is released, on the loop: serve now unless reports are queued for
        another thread. A failing callback is logged; the others still run."""
        if self.queued:
            return
        ready = self.ready
        while ready:
            for cb, error, report in self._reports(ready.popleft()):
                try:
                    cb(error, report)
                except Exception:
                    log.exception("delivery callback failed")


class Pending:
    """An awaitable delivery report of the ``AsyncProducer``: ``await`` gives the
    DeliveryReport (or BatchReport), or raises the delivery's error."""

    __slots__ = ("_done", "_error", "_report")

    def __init__(self):
        self._done = trio.Event()
        self._error = self._report = None

    def __call__(self, error, report) -> None:
        self._error, self._report = error, report
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._report
