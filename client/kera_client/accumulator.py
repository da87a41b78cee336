"""The producer's chunks before they leave: records gathered per streamlet, packed per request.

``Accumulator`` (the ``AsyncProducer``'s accumulating side, on any thread under
its lock) puts each record in its streamlet's open ``Outgoing`` chunk, seals a
chunk when it is full or its ``linger.ms`` is over (and its streamlet is not in a
request: ``_seal_expired``), and queues it in ``ready``
with the next sequence of its streamlet, where the sender (``sender``) takes it.

An ``Outgoing`` chunk collects one streamlet's records as plain lists while it is
open; sealing gives it its sequence and its size but packs nothing. The chunks
of a request are packed together, just before it is sent, by ``pack``: one
``chunk.pack_many`` pass over all of them (header fields as arrays, one
buffer), so a chunk of one record costs a few list operations, not a build.
A chunk keeps its bytes once packed: a resend sends the same ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from itertools import chain

import numpy as np
import trio

from kera import chunk as chunkfmt
from kera.errors import RecordTooLarge
from kera.limits import MAX_CHUNK

from .delivery import Pending
from .partitioner import RoundRobin, key_streamlet
from .stream_view import StreamView


class Outgoing:
    """One chunk: open (records still arrive), sealed (``seq`` set) and then packed (``data``)."""

    __slots__ = ("key", "values", "keys", "ts", "size", "deadline", "created", "sticky", "seq",
                 "records", "data", "start", "flags", "charged", "reports")

    def __init__(self, key: tuple, created: float, deadline: float, sticky: int):
        self.key = key
        self.values: list[bytes] = []
        self.keys: list[bytes | None] | None = None   # only once a record has a key
        self.ts: list[int] | None = None              # only once a record has its own timestamp
        self.size = 0           # open: 16 + key + value per record; sealed: the chunk's bytes
        self.created = created  # the first record's arrival: latencies and timestamps count from here
        self.deadline = deadline
        self.sticky = sticky    # the round-robin chunk of a stream of this many streamlets (0: keyed)
        self.seq = -1
        self.records = 0
        self.data = None        # once packed: the buffer holding the chunk at ``start``
        self.start = 0          # (its request's payload: no per-chunk object)
        self.flags = 0
        self.charged = 0        # bytes counted against buffer.memory until acked or given up (from sealing)
        self.reports = None     # its records' delivery callbacks (``delivery``), if any

    def chunk(self):
        """The packed chunk's bytes."""
        if self.start == 0 and len(self.data) == self.size:
            return self.data
        return memoryview(self.data)[self.start:self.start + self.size]

    @classmethod
    def packed(cls, key: tuple, seq: int, data, records: int, created: float, reports=None) -> Outgoing:
        """A chunk built elsewhere (the columnar path)."""
        c = cls(key, created, created, 0)
        c.seq, c.data, c.records, c.size, c.reports = seq, data, records, len(data), reports
        return c


def pack(items: list[Outgoing], producer_id: int) -> bytes | None:
    """Pack every chunk of ``items`` not packed yet, all in one pass; returns the request's
    payload when that was all of them (else the caller joins the chunks' own bytes)."""
    todo = [c for c in items if c.data is None]
    if not todo:
        return None
    counts = [c.records for c in todo]
    values = list(chain.from_iterable(c.values for c in todo))
    keys = None
    if any(c.keys is not None for c in todo):
        keys = list(chain.from_iterable(c.keys if c.keys is not None else [None] * c.records
                                        for c in todo))
    # records without their own timestamp get their chunk's first record's arrival, in wall
    # milliseconds: one clock reading for the request, not one per chunk
    to_wall = time.time() - time.monotonic()
    wall = ((np.fromiter([c.created for c in todo], np.float64, len(todo)) + to_wall) * 1000).astype(np.int64)
    if any(c.ts is not None for c in todo):
        ts = list(chain.from_iterable(c.ts if c.ts is not None else [w] * c.records
                                      for c, w in zip(todo, wall.tolist(), strict=True)))
    else:
        ts = np.repeat(wall, counts)
    data, starts, sizes = chunkfmt.pack_many(
        [c.key[0] for c in todo], [c.key[1] for c in todo], producer_id, [c.seq for c in todo],
        [c.flags for c in todo], counts, values, keys, ts)
    for c, s in zip(todo, starts, strict=True):
        c.data, c.start = data, s
        c.values = c.keys = c.ts = None  # the bytes are in the chunk now
    return data if len(todo) == len(items) else None


_BYTES = (bytes, bytearray, memoryview)


def check_record(value, key, timestamp) -> None:
    """TypeError unless the value and key are bytes and the timestamp int milliseconds."""
    if (type(value) is not bytes and not isinstance(value, _BYTES)
            or key is not None and not isinstance(key, _BYTES)):
        raise TypeError(f"a record's value and key are bytes, not {type(value).__name__} / "
                        f"{type(key).__name__}")
    if timestamp is not None and type(timestamp) is not int:
        raise TypeError(f"a record's timestamp is int milliseconds, not {type(timestamp).__name__}")


def wall_ms(monotonic: float) -> int:
    """Wall-clock milliseconds of a moment taken with time.monotonic()."""
    return int((time.time() - (time.monotonic() - monotonic)) * 1000)


class Accumulator:
    """The accumulating side of ``AsyncProducer``: records -> open chunks -> sealed chunks in
    ``ready``. Its state is its own but for what it shares with the sender (set up by the
    producer): ``lock``, ``ready``, ``room``, ``buffered``, ``outstanding``, ``delivery``
    and the sender's wake-up events."""

    def __init__(self, cfg: dict):
        self.linger = float(cfg["linger.ms"]) / 1000
        self.chunk_size = min(int(cfg["chunk.size"]), MAX_CHUNK)
        self.buffer_memory = int(cfg["buffer.memory"])
        self.by_key = cfg["partitioner"] != "round-robin"
        self.rr = RoundRobin()
        self.batches: dict[tuple, Outgoing] = {}
        self.sticky: dict[int, Outgoing] = {}   # stream id -> open round-robin chunk
        self.linger_q: deque = deque()
        self.due: dict[tuple, Outgoing] = {}    # lingered out while their streamlet was in a request
        self.seq: dict[tuple, int] = {}
        self._woken = False
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()

    def _notify(self) -> None:
        """Wake the sender, at most once per round of it (not once per chunk)."""
        if self._woken:
            return
        self._woken = True
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            self._token.run_sync_soon(self._wake_now)

    def _wake_now(self) -> None:
        self._wake.set()  # the event current when this runs, not when it was scheduled

    def _too_large(self, s: StreamView, n: int, what: str) -> RecordTooLarge:
        seg = s.segment_size
        bound = min(MAX_CHUNK, seg)
        size = chunkfmt.chunk_size(1, n - 16)
        return RecordTooLarge(
            f"{what} of {n - 16} bytes (key and value) needs a chunk of {size} bytes; stream "
            f"{s.name!r} takes chunks of at most {bound} bytes (the smaller of MAX_CHUNK, {MAX_CHUNK}, "
            f"and its segment size, {seg})", limit="MAX_CHUNK" if bound == MAX_CHUNK else "segment_size",
            bound=bound, size=size)

    def _batch(self, s: StreamView, key) -> Outgoing:
        if key is None or not self.by_key:
            b = self.sticky.get(s.id)
            if b is None:
                n = s.streamlets
                b = self._open(s, self.rr.streamlet(s.id, n) if n > 1 else 0, n)
        else:
            b = self.batches.get((s.id, key_streamlet(key, s.streamlets)))
            if b is None:
                b = self._open(s, key_streamlet(key, s.streamlets), 0)
        return b

    def _append(self, s: StreamView, value: bytes, key, timestamp, cb=None) -> None:
        """Add one record to its streamlet's open chunk (caller holds the lock).

        The hot path of ``send``: a few attribute and dict operations, no
        allocation but the list slots; chunks are packed when sealed. A record
        that no chunk of its stream could hold is refused here, at once.
        """
        check_record(value, key, timestamp)
        n = len(value) + 16 if key is None else len(value) + len(key) + 16
        room = self.room[s.id]
        if n > room:
            if cb is None:
                raise self._too_large(s, n, "record")
            self.delivery.refused(s.name, key, value, cb, self._too_large(s, n, "record"))
            return
        b = self.sticky.get(s.id) if key is None or not self.by_key else None
        if b is None:
            b = self._batch(s, key)
        if b.size + n > room:  # the open chunk would outgrow what the stream takes: seal it first
            self._seal(b)
            self._notify()
            b = self._batch(s, key)
        if key is not None or b.keys is not None:
            if b.keys is None:
                b.keys = [None] * len(b.values)
            b.keys.append(key)
        if timestamp is not None or b.ts is not None:
            if b.ts is None:
                b.ts = [wall_ms(b.created)] * len(b.values)
            b.ts.append(timestamp if timestamp is not None else int(time.time() * 1000))
        if cb is not None:
            if b.reports is None:
                b.reports = []
                self.delivery.used = True
            b.reports.append((len(b.values), cb, time.monotonic(), key, value))
        b.values.append(value)
        b.size += n
        self.buffered += n
        self.outstanding += 1
        if b.size >= self.chunk_size:
            self._seal(b)
            if not self._woken:
                self._notify()

    def _open(self, s: StreamView, streamlet: int, sticky: int) -> Outgoing:
        now = time.monotonic()
        k = (s.id, streamlet)
        old = self.batches.get(k)
        if old is not None:  # a keyed chunk open where round-robin put a keyless record: it leaves
            self._seal(old)  # first (replaced, it would be sealed by nothing and lost)
            self._notify()
        b = self.batches[k] = Outgoing(k, now, now + self.linger, sticky)
        if sticky:
            self.sticky[s.id] = b
        self.linger_q.append(b)  # open chunks, oldest deadline first
        if len(self.linger_q) == 1:
            self._notify()
        return b

    def _seal(self, b: Outgoing) -> None:
        """Close the open chunk and queue it with the next sequence (as ``_enqueue``, inline:
        once per chunk); it is packed with the other chunks of the request it leaves in
        (``accumulator.pack``)."""
        k = b.key
        del self.batches[k]
        if b.sticky:
            del self.sticky[k[0]]
            if b.sticky > 1:
                self.rr.sealed(k[0], b.sticky)
        b.seq = seq = self.seq.get(k, 0)
        b.records = n = len(b.values)
        b.charged = b.size      # what its records added to ``buffered``
        b.size = chunkfmt.chunk_size(n, b.size - 16 * n)
        self.seq[k] = seq + 1
        q = self.ready.get(k)
        if q is None:
            q = self.ready[k] = deque()
        q.append(b)

    def _enqueue(self, c: Outgoing) -> None:
        """Queue a sealed chunk: only now is its sequence taken, so a build that failed
        leaves no hole."""
        k = c.key
        self.seq[k] = c.seq + 1
        q = self.ready.get(k)
        if q is None:
            q = self.ready[k] = deque()
        q.append(c)

    def _wait_space(self) -> None:
        """Block the calling (non-loop) thread while the buffer is full."""
        while self.buffered >= self.buffer_memory:
            self.space.wait(0.1)

    async def send(self, stream: str, value: bytes, key: bytes | None = None, timestamp: int | None = None,
                   on_delivery=None, report: bool = False) -> Pending | None:
        """Queue one record. ``on_delivery(error, DeliveryReport)`` is called once with its
        outcome (default: the producer's); ``report=True`` returns a ``Pending`` to await instead.
        A record to a stream not known yet waits for its lookup (``lookups``), not the caller:
        if the stream does not exist, its report (or ``flush``) says so."""
        cb = Pending() if report else on_delivery or self.delivery.default
        while self.buffered >= self.buffer_memory:
            await self._progress.wait()
        s = self.streams.get(stream)
        with self.lock:
            if s is None:   # looked up with the other streams met meanwhile (``lookups``)
                self._park(stream, value, key, timestamp, cb)
            else:
                self._append(s, value, key, timestamp, cb)
        if self.delivery.ready:
            self.delivery.hand()
        return cb if report else None

    def _seal_expired(self, now: float) -> None:
        """Seal the open chunks whose ``linger.ms`` is over (the sender's loop, under the lock).

        One whose streamlet is in a request could only wait sealed behind it (a streamlet
        is in one request at a time): it stays open, taking records up to ``chunk.size``,
        and is sealed when that request is settled (``_release``). So under load chunks
        grow instead of queueing one or two records each, as a Kafka producer's batches do
        while their partition waits to be sent."""
        q = self.linger_q
        busy = self.inflight_keys
        while q and q[0].deadline <= now:
            b = q.popleft()
            if self.batches.get(b.key) is b:
                if b.key in busy:
                    self.due[b.key] = b
                else:
                    self._seal(b)

    def _release(self, k: tuple) -> None:
        """Streamlet ``k`` left its request: seal its open chunk if its linger ran out meanwhile."""
        b = self.due.pop(k, None)
        if b is not None and self.batches.get(k) is b:
            self._seal(b)

    def seal_all(self) -> None:
        """Seal every open chunk, lingering or not."""
        with self.lock:
            for b in list(self.batches.values()):
                self._seal(b)
            self.linger_q.clear()

