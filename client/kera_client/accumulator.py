"""The producer's chunks before they leave: records gathered per streamlet, packed per request.

``Accumulator`` puts each record in its lane's open ``Outgoing`` chunk (any
thread, under the producer's lock), seals a chunk when it is full, or when its
``linger.ms`` is over and the sender takes its lane (``seal_expired``: until then
it keeps taking records), and queues it on its lane with the lane's next sequence.
A lane with sealed or due chunks that is not in a request *waits* in ``waiting``, a queue per broker address,
where the sender (``sender``) takes lanes from: a round costs the lanes sent,
not a walk of every streamlet the producer knows.

An ``Outgoing`` chunk collects one streamlet's records as plain lists while it is
open; sealing gives it its sequence and its size but packs nothing. The chunks
of a request are packed together, just before it is sent, by ``pack``: one
``chunk.pack_many`` pass over all of them (header fields as arrays, one
buffer), so a chunk of one record costs a few list operations, not a build.
A chunk keeps its bytes once packed: a resend sends the same ones.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import chain

import numpy as np

from kera import chunk as chunkfmt
from kera.errors import RecordTooLarge
from kera.limits import MAX_CHUNK

from .delivery import Deliveries
from .lanes import Buffer, Lane, Route, Waker
from .partitioner import key_streamlet

HEADER = chunkfmt.HEADER_SIZE


class Outgoing:
    """One chunk: open (records still arrive), sealed (``seq`` set) and then packed (``data``)."""

    __slots__ = ("lane", "values", "keys", "ts", "size", "deadline", "created", "sticky", "seq",
                 "records", "data", "start", "flags", "charged", "reports")

    def __init__(self, lane: Lane, created: float, deadline: float, sticky: int):
        self.lane = lane
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

    @property
    def key(self) -> tuple[int, int]:
        """(stream id, streamlet)."""
        return self.lane.route.id, self.lane.index

    def chunk(self):
        """The packed chunk's bytes."""
        if self.start == 0 and len(self.data) == self.size:
            return self.data
        return memoryview(self.data)[self.start:self.start + self.size]

    @classmethod
    def packed(cls, lane: Lane, seq: int, data, records: int, created: float, reports=None) -> Outgoing:
        """A chunk built elsewhere (the columnar path)."""
        c = cls(lane, created, created, 0)
        c.seq, c.data, c.records, c.size, c.reports = seq, data, records, len(data), reports
        return c


def pack(items: list[Outgoing], producer_id: int) -> bytes | None:
    """Pack every chunk of ``items`` not packed yet, all in one pass; returns the request's
    payload when that was all of them (else the caller joins the chunks' own bytes)."""
    todo = [c for c in items if c.data is None]
    if not todo:
        return None
    counts = [c.records for c in todo]
    values = list(chain.from_iterable([c.values for c in todo]))
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
    data, starts, _ = chunkfmt.pack_many(
        [c.lane.route.id for c in todo], [c.lane.index for c in todo], producer_id, [c.seq for c in todo],
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


def too_large(route: Route, n: int, what: str) -> RecordTooLarge:
    seg = route.segment_size
    bound = min(MAX_CHUNK, seg)
    size = chunkfmt.chunk_size(1, n - 16)
    return RecordTooLarge(
        f"{what} of {n - 16} bytes (key and value) needs a chunk of {size} bytes; stream "
        f"{route.name!r} takes chunks of at most {bound} bytes (the smaller of MAX_CHUNK, {MAX_CHUNK}, "
        f"and its segment size, {seg})", limit="MAX_CHUNK" if bound == MAX_CHUNK else "segment_size",
        bound=bound, size=size)


class Accumulator:
    """Records -> open chunks -> sealed chunks on their lanes -> lanes waiting for the sender.
    It owns the open chunks (``linger_q``, oldest deadline first) and ``waiting``; the
    lanes' sequences and queues are written here only (the sender takes and returns chunks
    through ``take`` / ``requeue`` / ``release``). Called under ``buffer.lock``."""

    def __init__(self, cfg: dict, buffer: Buffer, delivery: Deliveries, waker: Waker):
        self.linger = float(cfg["linger.ms"]) / 1000
        self.chunk_size = min(int(cfg["chunk.size"]), MAX_CHUNK)
        self.by_key = cfg["partitioner"] != "round-robin"
        self.buffer, self.delivery, self.waker = buffer, delivery, waker
        self.linger_q: deque[Outgoing] = deque()
        # address (None: no live owner) -> lanes with sealed chunks, not in a request, in turn
        self.waiting: dict[str | None, deque[Lane]] = {}

    # -- records in ------------------------------------------------------------------------
    def append(self, route: Route, value: bytes, key, timestamp, cb=None) -> None:
        """Add one record to its streamlet's open chunk (caller holds the lock).

        The hot path of ``send``: a few attribute and list operations; chunks are packed
        when they leave. A record that no chunk of its stream could hold is refused here,
        at once."""
        check_record(value, key, timestamp)
        n = len(value) + 16 if key is None else len(value) + len(key) + 16
        room = route.room
        if n > room:
            if cb is None:
                raise too_large(route, n, "record")
            self.delivery.refused(route.name, key, value, cb, too_large(route, n, "record"))
            return
        b = self._chunk_for(route, key)
        if b.size + n > room:  # the open chunk would outgrow what the stream takes: seal it first
            self.seal(b)
            self.waker.notify()
            b = self._chunk_for(route, key)
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
        self.buffer.bytes += n
        self.buffer.records += 1
        if b.size >= self.chunk_size:
            self.seal(b)
            self.waker.notify()

    def _chunk_for(self, route: Route, key) -> Outgoing:
        """The open chunk a record of ``key`` joins (opened if none)."""
        if key is None or not self.by_key:
            b = route.sticky
            if b is None:
                n = route.streamlets
                b = self._open(route, route.rr if n > 1 else 0, n)
            return b
        i = key_streamlet(key, route.streamlets)
        lane = route.lanes[i]
        b = lane.open if lane is not None else None
        return b if b is not None else self._open(route, i, 0)

    def _open(self, route: Route, index: int, sticky: int) -> Outgoing:
        lane = route.lanes[index] or route.lane(index)
        if lane.open is not None:  # a keyed chunk open where round-robin put a keyless record: it
            self.seal(lane.open)   # leaves first (replaced, it would be sealed by nothing and lost)
            self.waker.notify()
        now = time.monotonic()
        b = lane.open = Outgoing(lane, now, now + self.linger, sticky)
        if sticky:
            route.sticky = b
        self.linger_q.append(b)  # open chunks, oldest deadline first
        if len(self.linger_q) == 1:
            self.waker.notify()
        return b

    # -- sealing ---------------------------------------------------------------------------
    def seal(self, b: Outgoing) -> None:
        """Close the open chunk and queue it on its lane with the lane's next sequence; it is
        packed with the other chunks of the request it leaves in (``pack``)."""
        lane = b.lane
        lane.open = None
        if lane.due is b:
            lane.due = None
        if b.sticky:
            route = lane.route
            route.sticky = None
            if b.sticky > 1:
                route.rr = (route.rr + 1) % b.sticky
        b.seq = lane.seq
        lane.seq += 1
        b.records = len(b.values)
        b.charged = b.size      # what its records added to ``buffer.bytes``
        b.size = HEADER + ((b.size + 15) & ~7)   # chunk_size: the index, keys and values, padded
        q = lane.queue
        if q is None:
            q = lane.queue = []
        q.append(b)
        if not lane.busy and not lane.waits:
            self._wait(lane)

    def enqueue(self, lane: Lane, c: Outgoing) -> None:
        """Queue a chunk built whole (``columnar``): only now is its sequence taken, so a build
        that failed leaves no hole."""
        lane.seq = c.seq + 1
        q = lane.queue
        if q is None:
            q = lane.queue = []
        q.append(c)
        if not lane.busy and not lane.waits:
            self._wait(lane)

    def seal_expired(self, now: float) -> None:
        """Seal the open chunks whose ``linger.ms`` is over (the sender's loop, under the lock).

        One whose streamlet is in a request could only wait sealed behind it (a streamlet
        is in one request at a time): it stays open, taking records up to ``chunk.size``,
        and is sealed when that request is settled (``release``). One whose lane is free is
        *due*: its lane waits for the sender with the chunk still open, sealed when the
        sender takes the lane (``take_due``). So under load, while lanes wait for a free
        request, chunks grow instead of queueing one or two records each, as a Kafka
        producer's batches do while their partition waits to be sent; unloaded, the sender
        takes the lane in the same round and nothing changes."""
        q = self.linger_q
        while q and q[0].deadline <= now:
            b = q.popleft()
            lane = b.lane
            if lane.open is b:
                lane.due = b
                if not lane.busy and not lane.waits:
                    self._wait(lane)

    def take_due(self, lane: Lane) -> None:
        """The sender takes ``lane`` (still in ``waiting``): its due chunk is sealed now."""
        b = lane.due
        if b is not None and not lane.busy and lane.open is b:
            self.seal(b)

    def add_sealed(self, route: Route, values: list, size: int, since: float) -> bool:
        """Keyless records without callbacks or timestamps of their own, parked since ``since``
        for their stream's lookup and lingered out meanwhile, as one chunk sealed at once on
        the round-robin streamlet: what ``append`` and ``seal`` would do, without an open
        chunk (the common first records of a stream). False if they are not such (the caller
        appends them one by one)."""
        n = route.streamlets
        i = route.rr if n > 1 else 0
        lane = route.lanes[i] or route.lane(i)
        if lane.open is not None or lane.busy or size > route.room or size >= self.chunk_size \
                or since + self.linger > time.monotonic():
            return False
        c = Outgoing(lane, since, since, n)
        c.values, c.records, c.charged = values, len(values), size
        c.size = HEADER + ((size + 15) & ~7)
        c.seq = lane.seq
        lane.seq += 1
        if n > 1:
            route.rr = (i + 1) % n
        lane.queue = [c] if lane.queue is None else [*lane.queue, c]
        if not lane.waits:
            self._wait(lane)
        self.buffer.bytes += size
        self.buffer.records += len(values)
        return True

    def seal_lingered(self, route: Route, since: float) -> None:
        """``route``'s open chunks, whose first records were sent at ``since`` (parked for its
        lookup), are sealed now if their linger is over."""
        if since + self.linger > time.monotonic():
            return
        for lane in route.lanes:
            if lane is not None and lane.open is not None and not lane.busy:
                self.seal(lane.open)

    def seal_all(self) -> None:
        """Seal every open chunk, lingering or not."""
        for b in list(self.linger_q):
            if b.lane.open is b:
                self.seal(b)
        self.linger_q.clear()

    # -- lanes and the sender --------------------------------------------------------------
    def _wait(self, lane: Lane) -> None:
        """``lane`` has sealed or due chunks and is not in a request: it waits under its address."""
        addr = lane.route.addrs[lane.index]
        q = self.waiting.get(addr)
        if q is None:
            q = self.waiting[addr] = deque()
        q.append(lane)
        lane.waits, lane.at = True, addr
        if not self.waker.woken:
            self.waker.notify()   # the sender's next round takes it

    def rewait(self, lane: Lane) -> None:
        """A lane taken from ``waiting`` but not sent (its owner moved, its retry is not due)."""
        if (lane.queue or lane.due is not None) and not lane.busy and not lane.waits:
            self._wait(lane)

    def release(self, lane: Lane) -> None:
        """``lane`` left its request: it waits again if chunks are queued or its open chunk
        lingered out meanwhile (due: sealed when the sender takes the lane)."""
        lane.busy = False
        if lane.due is not None and lane.open is not lane.due:
            lane.due = None
        if (lane.queue or lane.due is not None) and not lane.waits:
            self._wait(lane)

    def requeue(self, lane: Lane, chunks: list, at: float) -> None:
        """Chunks of ``lane`` refused for a reason that passes: back at the front of its queue
        in sequence order, not sent again before ``at``."""
        q = lane.queue
        if q is None:
            q = lane.queue = []
        q[:0] = chunks
        lane.retry_at = at

    def fail(self, chunks, why: str) -> None:
        """Chunks given up on (settled as failed); the next chunk sent after them on their
        streamlet gets SEQ_RESET (the broker would otherwise wait for the missing sequences
        forever)."""
        buf = self.buffer
        for c in chunks:
            buf.failed += c.records
            buf.records -= c.records
            buf.bytes -= c.charged
            lane = c.lane
            if lane.gap is None or c.seq > lane.gap:
                lane.gap = c.seq
            if c.reports is not None:
                self.delivery.settle(c, lane.route.name, why)
            else:
                self.delivery.failed_silently(c, why)
        buf.space.notify_all()
