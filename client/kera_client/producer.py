"""Producers: records -> chunks (one per streamlet) -> requests (one per broker).

``send`` appends a record to its streamlet's open chunk; a chunk is sealed
when it reaches ``chunk.size`` or has waited ``linger.ms``; sealed chunks get
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
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from itertools import pairwise

import numpy as np
import trio

from kera import chunk as chunkfmt
from kera.coordinator_link import CoordinatorLink
from kera.errors import KeraError, RecordTooLarge, UnknownStream
from kera.limits import MAX_CHUNK, MAX_REQUEST
from kera.rpc import open_pool, unwrapped

from .accumulator import Outgoing, pack
from .admin import default_coordinator, suspect
from .delivery import TIMEOUT, BatchWaiter, Deliveries, Pending
from .partitioner import RoundRobin, key_streamlet
from .portal import Portal

log = logging.getLogger("kera.producer")

REFRESH_MIN, REFRESH_MAX = 0.05, 2.0  # metadata refresh backoff, seconds

RETRIABLE = {"not_owner", "recovering", "fenced", "out_of_order_sequence", "unavailable",
             "not_enough_backups", "backup", "internal"}

DEFAULTS = {
    "acks": "all",
    "linger.ms": 5.0,
    "chunk.size": 16384,
    "request.size": 1 << 20,
    "max.in.flight": 4,
    "partitioner": "key",
    "buffer.memory": 256 << 20,
    "delivery.timeout.ms": 120_000,
    "request.timeout.ms": 30_000,
}


def _config(config: dict | None, kw: dict) -> dict:
    cfg = dict(DEFAULTS)
    for src in (config or {}), kw:
        for k, v in src.items():
            k = k.replace("_", ".")
            if k not in cfg:
                raise ValueError(f"unknown producer option {k!r}; known: {', '.join(cfg)}")
            cfg[k] = v
    for k in ("chunk.size", "request.size", "max.in.flight", "buffer.memory"):
        if not isinstance(cfg[k], numbers.Integral) or cfg[k] < 1:
            raise ValueError(f"{k} must be a positive integer, not {cfg[k]!r}")
    if cfg["acks"] not in ("all", "leader", "none"):
        raise ValueError("acks must be all, leader or none")
    if cfg["partitioner"] not in ("key", "round-robin"):
        raise ValueError("partitioner must be key (default: a record's key hash picks its streamlet, "
                         "records without key go sticky round-robin) or round-robin (keys ignored)")
    return cfg


class ProduceError(KeraError):
    code = "produce"


def _offsets(items) -> tuple[np.ndarray, bytes]:
    """Arrow-style offsets (int64[n + 1]) and the joined bytes of a list of byte strings."""
    off = np.zeros(len(items) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, items), np.int64, len(items)), out=off[1:])
    return off, b"".join(items)


def _cut(size: np.ndarray, chunk_size: int, room: int) -> list[int]:
    """Chunk bounds over records of ``size`` bytes (16 + key + value): a chunk ends where its
    records reach ``chunk_size``, and never holds more than ``room`` (no record is larger)."""
    n = len(size)
    cum = np.cumsum(size)
    marks = np.arange(chunk_size, int(cum[-1]) + chunk_size, chunk_size)
    bounds = np.unique(np.clip(np.searchsorted(cum, marks, side="right"), 1, n))
    bounds = np.concatenate([[0], bounds[bounds < n], [n]]).tolist()
    # a chunk holds less than chunk_size plus its first record: one over room is cut where
    # room ends, and the rest (less than chunk_size) fits (one step per chunk, not per record)
    out = [0]
    for a, b in pairwise(bounds):
        base = int(cum[a - 1]) if a else 0
        if int(cum[b - 1]) - base > room:
            out.append(int(np.searchsorted(cum, base + room, side="right")))
        out.append(b)
    return out


_BYTES = (bytes, bytearray, memoryview)


def _wall_ms(monotonic: float) -> int:
    """Wall-clock milliseconds of a moment taken with time.monotonic()."""
    return int((time.time() - (time.monotonic() - monotonic)) * 1000)


class AsyncProducer:
    """The trio-native producer. Use ``open_producer`` (or ``Producer`` from sync code)."""

    def __init__(self, pool, nursery, coordinator: str, cfg: dict, deliveries: Deliveries | None = None):
        self.pool = pool
        self.nursery = nursery
        self.coordinator = CoordinatorLink(pool, coordinator)
        self.cfg = cfg
        self.acks = cfg["acks"]
        self.linger = float(cfg["linger.ms"]) / 1000
        self.chunk_size = min(int(cfg["chunk.size"]), MAX_CHUNK)
        self.request_size = min(int(cfg["request.size"]), MAX_REQUEST)
        self.max_in_flight = int(cfg["max.in.flight"])
        self.buffer_memory = int(cfg["buffer.memory"])
        self.delivery_timeout = cfg["delivery.timeout.ms"] / 1000
        self.request_timeout = cfg["request.timeout.ms"] / 1000
        self.by_key = cfg["partitioner"] != "round-robin"
        self.producer_id = 0
        self.streams: dict[str, dict] = {}
        self.by_id: dict[int, dict] = {}
        self.rr = RoundRobin()
        self.batches: dict[tuple, Outgoing] = {}
        self.sticky: dict[int, Outgoing] = {}   # stream id -> open round-robin chunk
        self.linger_q: deque = deque()
        self.seq: dict[tuple, int] = {}
        self.gaps: dict[tuple, int] = {}       # streamlet -> highest sequence given up, not yet reset
        self.room: dict[int, int] = {}         # stream id -> record bytes one chunk holds
        self.ready: dict[tuple, deque] = {}
        self.inflight_keys: set = set()
        self.inflight: dict[str, int] = {}
        self.retry_at: dict[tuple, float] = {}
        self.stale: set[str] = set()
        self.refresh_at = 0.0                  # no metadata refresh before this time
        self.refresh_backoff = REFRESH_MIN
        self.buffered = 0
        self.outstanding = 0     # records not yet acknowledged nor failed
        self.acked = 0           # records acknowledged
        self.failed = 0          # records given up on
        self.delivery = deliveries or Deliveries()
        self.latencies: deque = deque(maxlen=100_000)  # seconds, a chunk's first record -> ack
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)
        self._wake = trio.Event()
        self._woken = False
        self._progress = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()

    # -- metadata ----------------------------------------------------------------
    async def _load(self, names) -> None:
        r, _ = await self.coordinator.call("metadata", {"names": list(names)},
                                    timeout=self.request_timeout)
        with self.lock:
            for s in r["streams"]:
                self.streams[s["name"]] = s
                self.by_id[s["id"]] = s
                self.room[s["id"]] = chunkfmt.record_room(min(MAX_CHUNK, s["segment_size"]))
        if r.get("missing"):
            e = UnknownStream(f"unknown streams: {', '.join(r['missing'])}")
            e.missing = r["missing"]
            raise e

    async def load_metadata(self, names) -> None:
        """Fetch where many streams live in one call (else each first send asks alone)."""
        await self._load([n for n in names if n not in self.streams])

    async def stream(self, name: str) -> dict:
        s = self.streams.get(name)
        if s is None:
            await self._load([name])
            s = self.streams[name]
        return s

    # -- accumulation (any thread) ------------------------------------------------
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

    def _too_large(self, s: dict, n: int, what: str) -> RecordTooLarge:
        seg = s["segment_size"]
        bound = min(MAX_CHUNK, seg)
        size = chunkfmt.chunk_size(1, n - 16)
        return RecordTooLarge(
            f"{what} of {n - 16} bytes (key and value) needs a chunk of {size} bytes; stream "
            f"{s['name']!r} takes chunks of at most {bound} bytes (the smaller of MAX_CHUNK, {MAX_CHUNK}, "
            f"and its segment size, {seg})", limit="MAX_CHUNK" if bound == MAX_CHUNK else "segment_size",
            bound=bound, size=size)

    def _batch(self, s: dict, key) -> Outgoing:
        if key is None or not self.by_key:
            b = self.sticky.get(s["id"])
            if b is None:
                b = self._open(s, self.rr.streamlet(s["id"], s["streamlets"]), True)
        else:
            b = self.batches.get((s["id"], key_streamlet(key, s["streamlets"])))
            if b is None:
                b = self._open(s, key_streamlet(key, s["streamlets"]), False)
        return b

    def _append(self, s: dict, value: bytes, key, timestamp, cb=None) -> None:
        """Add one record to its streamlet's open chunk (caller holds the lock).

        The hot path of ``send``: a few attribute and dict operations, no
        allocation but the list slots; chunks are packed when sealed. A record
        that no chunk of its stream could hold is refused here, at once.
        """
        if not isinstance(value, _BYTES) or key is not None and not isinstance(key, _BYTES):
            raise TypeError(f"a record's value and key are bytes, not {type(value).__name__} / "
                            f"{type(key).__name__}")
        if timestamp is not None and type(timestamp) is not int:
            raise TypeError(f"a record's timestamp is int milliseconds, not {type(timestamp).__name__}")
        n = len(value) + 16 if key is None else len(value) + len(key) + 16
        room = self.room[s["id"]]
        if n > room:
            if cb is None:
                raise self._too_large(s, n, "record")
            self.delivery.refused(s["name"], key, value, cb, self._too_large(s, n, "record"))
            return
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
                b.ts = [_wall_ms(b.created)] * len(b.values)
            b.ts.append(timestamp if timestamp is not None else int(time.time() * 1000))
        if cb is not None:
            if b.reports is None:
                b.reports = []
                self.delivery.used = True
            b.reports.append((len(b.values), cb, time.monotonic(), key, value))
        b.values.append(value)
        b.size += n
        b.charged += n
        self.buffered += n
        self.outstanding += 1
        if b.size >= self.chunk_size:
            self._seal(b)
            self._notify()

    def _open(self, s: dict, streamlet: int, sticky: bool) -> Outgoing:
        now = time.monotonic()
        k = (s["id"], streamlet)
        b = self.batches[k] = Outgoing(k, now, now + self.linger, sticky)
        if sticky:
            self.sticky[s["id"]] = b
        self.linger_q.append(b)  # open chunks, oldest deadline first
        if len(self.linger_q) == 1:
            self._notify()
        return b

    def _seal(self, b: Outgoing) -> None:
        """Close the open chunk and queue it with the next sequence; it is packed with the
        other chunks of the request it leaves in (``accumulator.pack``)."""
        k = b.key
        del self.batches[k]
        if b.sticky:
            del self.sticky[k[0]]
            self.rr.sealed(k[0], self.by_id[k[0]]["streamlets"])
        # records without their own timestamp get the chunk's first record's arrival
        b.seal(self.seq.get(k, 0), _wall_ms(b.created) if b.ts is None else 0)
        self._enqueue(b)

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
        outcome (default: the producer's); ``report=True`` returns a ``Pending`` to await instead."""
        cb = Pending() if report else on_delivery or self.delivery.default
        try:
            s = self.streams.get(stream) or await self.stream(stream)
        except UnknownStream as e:
            if cb is None:
                raise
            with self.lock:
                self.delivery.refused(stream, key, value, cb, e)
            self.delivery.hand()
            return cb if report else None
        while self.buffered >= self.buffer_memory:
            await self._progress.wait()
        with self.lock:
            self._append(s, value, key, timestamp, cb)
        if self.delivery.ready:
            self.delivery.hand()
        return cb if report else None

    async def send_many(self, stream: str, values, keys=None, streamlet: int | None = None,
                        on_delivery=None, report: bool = False) -> Pending | None:
        """Send many records at once, packed into chunks with numpy.

        ``values`` is a list of bytes or a 2-D uint8 array (one row per record),
        ``keys`` an optional list (None: no key), stored but not used to
        partition: records go to ``streamlet`` (default: round-robin per chunk).
        """
        if isinstance(values, np.ndarray):
            if values.ndim != 2 or values.dtype != np.uint8:
                raise ValueError("values array must be 2-D uint8 (one row per record)")
            n, size = values.shape
            voff = np.arange(0, (n + 1) * size, size, dtype=np.int64)
            vdata = np.ascontiguousarray(values).reshape(-1)
        else:
            voff, vdata = _offsets(values)
        koff, kdata = (None, b"") if keys is None else _offsets([k or b"" for k in keys])
        return await self.send_columns(stream, voff, vdata, koff, kdata, None, streamlet, on_delivery, report)

    async def send_columns(self, stream: str, value_offsets, value_data, key_offsets=None,
                           key_data=b"", timestamps=None, streamlet: int | None = None,
                           on_delivery=None, report: bool = False) -> Pending | None:
        """Send records given as columns, Arrow's binary layout: ``value_offsets`` (int[n + 1])
        into ``value_data``, optionally the same for keys (length 0: no key) and int64
        millisecond ``timestamps``. Chunks are cut and packed with numpy: no per-record work.

        ``on_delivery(error, BatchReport)`` is called once, when all its chunks are acknowledged
        or given up on (``error``: the first failure); ``report=True`` returns a ``Pending``."""
        cb = Pending() if report else on_delivery
        w = None if cb is None else BatchWaiter(cb, stream)
        s = self.streams.get(stream) or await self.stream(stream)
        voff = np.asarray(value_offsets, dtype=np.int64)
        koff = None if key_offsets is None else np.asarray(key_offsets, dtype=np.int64)
        n = len(voff) - 1
        if n <= 0:
            return self._closed(w, cb)
        ts = np.full(n, int(time.time() * 1000), np.int64) if timestamps is None \
            else np.asarray(timestamps, dtype=np.int64)
        size = np.diff(voff) + 16
        if koff is not None:
            size += np.diff(koff)
        room = self.room[s["id"]]
        big = int(np.argmax(size))
        if int(size[big]) > room:  # refused before any of them leaves
            raise self._too_large(s, int(size[big]), f"record {big} of {n}")
        bounds = _cut(size, min(self.chunk_size, room), room)
        vdata, kdata = memoryview(value_data), memoryview(key_data)
        try:
            await self._queue_columns(s, bounds, voff, vdata, koff, kdata, ts, streamlet, w)
        except BaseException as e:   # cancelled or failed part-way: the report still comes, once
            if w is not None:
                with self.lock:
                    w.failed += n - w.queued
                    if w.error is None:
                        w.error = e if isinstance(e, KeraError) else KeraError(
                            f"send_columns stopped after {w.queued} of {n} records: {e!r}")
                self._closed(w, cb)
            raise
        return self._closed(w, cb)

    async def _queue_columns(self, s, bounds, voff, vdata, koff, kdata, ts, streamlet, w) -> None:
        for a, b in pairwise(bounds):
            v0, v1 = int(voff[a]), int(voff[b])
            if koff is None:
                ko, kb = np.zeros(b - a + 1, np.uint32), b""
            else:
                k0, k1 = int(koff[a]), int(koff[b])
                ko, kb = (koff[a:b + 1] - k0).astype(np.uint32), kdata[k0:k1]
            while self.buffered >= self.buffer_memory:
                await self._progress.wait()
            with self.lock:
                sl = streamlet if streamlet is not None else self.rr.streamlet(s["id"], s["streamlets"])
                if streamlet is None:
                    self.rr.sealed(s["id"], s["streamlets"])
                k = (s["id"], sl)
                seq = self.seq.get(k, 0)
                data = chunkfmt.build_arrays(k[0], sl, self.producer_id, seq, ts[a:b], ko,
                                             kb, (voff[a:b + 1] - v0).astype(np.uint32), vdata[v0:v1])
                c = Outgoing.packed(k, seq, data, b - a, time.monotonic(), w)
                c.charged = len(data)
                self.buffered += len(data)
                self.outstanding += b - a
                if w is not None:
                    w.pending += 1
                    w.queued += b - a
                    self.delivery.used = True
                self._enqueue(c)
            self._notify()

    def _closed(self, w: BatchWaiter | None, cb):
        """A batch call has queued all its chunks: its report may now go out."""
        if w is None:
            return None
        with self.lock:
            self.delivery.close(w)
            self.space.notify_all()
        self.delivery.hand()
        return cb if isinstance(cb, Pending) else None

    # -- sending (loop thread) ----------------------------------------------------
    def _seal_expired(self, now: float) -> None:
        q = self.linger_q
        while q and q[0].deadline <= now:
            b = q.popleft()
            if self.batches.get(b.key) is b:
                self._seal(b)

    def seal_all(self) -> None:
        with self.lock:
            for b in list(self.batches.values()):
                self._seal(b)
            self.linger_q.clear()

    def _dispatch(self, now: float) -> float:
        """Start requests for brokers with ready chunks; returns the next retry time."""
        next_retry = math.inf
        plans: dict[str, list] = {}
        sizes: dict[str, int] = {}
        with self.lock:
            for k in list(self.ready):
                q = self.ready[k]
                if not q:
                    del self.ready[k]
                    continue
                if k in self.inflight_keys:
                    continue
                t = self.retry_at.get(k, 0)
                if t > now:
                    next_retry = min(next_retry, t)
                    continue
                s = self.by_id.get(k[0])
                addr = s["addrs"][k[1]] if s is not None else None
                if addr is None:
                    if s is not None:
                        self.stale.add(s["name"])
                    while q and now - q[0].created > self.delivery_timeout:  # no owner for too long
                        self._give_up([q.popleft()], TIMEOUT)
                    self.retry_at[k] = now + 0.05
                    next_retry = min(next_retry, now + 0.05)
                    continue
                if self.inflight.get(addr, 0) >= self.max_in_flight:
                    continue
                if sizes.get(addr, 0) >= self.request_size:
                    continue
                items = plans.setdefault(addr, [])
                taken = len(items)
                gap = self.gaps.get(k)
                while q and (sizes.get(addr, 0) == 0 or sizes[addr] + q[0].size <= self.request_size):
                    c = q.popleft()
                    if now - c.created > self.delivery_timeout:
                        self._give_up([c], TIMEOUT)
                        gap = self.gaps[k]
                        continue
                    if gap is not None and c.seq > gap:  # the first chunk after a hole: a new base
                        if c.data is None:
                            c.flags |= chunkfmt.SEQ_RESET
                        else:
                            c.data, c.start = chunkfmt.with_flags(c.chunk(), chunkfmt.SEQ_RESET), 0
                        del self.gaps[k]
                        gap = None
                    items.append(c)
                    sizes[addr] = sizes.get(addr, 0) + c.size
                if len(items) > taken:
                    self.inflight_keys.add(k)
                if not q:
                    del self.ready[k]
                elif len(items) > taken:
                    # served: to the back, so the streamlets after it go first next time (else,
                    # with a deep buffer, the first ones in the dict always fill the requests
                    # and the others' records wait, and age, in the buffer)
                    self.ready[k] = self.ready.pop(k)
            for addr, items in plans.items():
                if items:
                    self.inflight[addr] = self.inflight.get(addr, 0) + 1
                    self.nursery.start_soon(self._request, addr, items)
        if self.delivery.ready:
            self.delivery.hand()
        if self.stale:
            if now >= self.refresh_at:
                self.refresh_at = math.inf  # one refresh at a time
                self.nursery.start_soon(self._refresh)
            else:
                next_retry = min(next_retry, self.refresh_at)
        return next_retry

    async def _refresh(self) -> None:
        """Metadata of streams whose owners moved; backs off while the coordinator is away."""
        names, self.stale = self.stale, set()
        try:
            try:
                await self._load(names)
            except UnknownStream as e:  # deleted: its chunks fail with the error, others were loaded
                self._forget(set(e.missing))
            self.refresh_backoff = REFRESH_MIN
            self.refresh_at = 0.0
        except KeraError as e:
            if self.refresh_backoff == REFRESH_MIN:
                log.warning("metadata refresh failed (retrying with backoff): %s", e)
            self.stale |= names
            self.refresh_at = time.monotonic() + self.refresh_backoff
            self.refresh_backoff = min(self.refresh_backoff * 2, REFRESH_MAX)
        self._wake.set()

    def _forget(self, names: set) -> None:
        """Streams that no longer exist: their queued chunks fail with UnknownStream."""
        with self.lock:
            for k in list(self.ready):
                s = self.by_id.get(k[0])
                if s is not None and s["name"] in names and k not in self.inflight_keys:
                    self._give_up(list(self.ready.pop(k)), UnknownStream.code)
            for name in names:
                self.streams.pop(name, None)
        self.delivery.hand()

    async def _request(self, addr: str, items: list) -> None:
        meta = {"producer": self.producer_id, "acks": self.acks}
        if self.delivery.used and any(c.reports is not None for c in items):
            meta["positions"] = True  # where each chunk was placed, for its delivery reports
        where = {}
        try:
            whole = pack(items, self.producer_id)
            r, _ = await self.pool.call(addr, "produce", meta,
                                        parts=[whole] if whole is not None else [c.chunk() for c in items],
                                        timeout=self.request_timeout)
            results = [None] * len(items)  # the broker names only the chunks it refused
            for i, code in r["errors"]:
                results[i] = code
            for i, g, seg, off in r.get("placed") or ():
                where[i] = (g, seg, off)
        except KeraError as e:
            log.info("produce to %s failed: %s", addr, e)
            results = [e.code] * len(items)
            self.pool.drop(addr)
            if e.code == "unavailable":
                self.nursery.start_soon(suspect, self.coordinator, addr)
        now = time.monotonic()
        with self.lock:
            self.inflight[addr] -= 1
            retry: dict[tuple, list] = {}
            for i, (c, res) in enumerate(zip(items, results, strict=False)):
                self.inflight_keys.discard(c.key)
                if res is None:
                    self.acked += c.records
                    self.outstanding -= c.records
                    self.buffered -= c.charged
                    self.latencies.append(now - c.created)
                    if c.reports is not None:
                        self.delivery.settle(c, self.by_id[c.key[0]]["name"], None, where.get(i))
                elif res in RETRIABLE:  # the chunks after a refused one come back out of order: retried
                    if c.data is not None and len(c.data) != c.size:
                        c.data, c.start = bytes(c.chunk()), 0   # keep its bytes, not its request's
                    retry.setdefault(c.key, []).append(c)
                else:
                    self._give_up([c], res)
            for k, cs in retry.items():
                q = self.ready.setdefault(k, deque())
                q.extendleft(reversed(cs))
                self.retry_at[k] = now + 0.1
                s = self.by_id.get(k[0])
                if s is not None:
                    self.stale.add(s["name"])
            self.space.notify_all()
        self.delivery.hand()
        self._progress.set()
        self._progress = trio.Event()
        self._wake.set()

    def _give_up(self, cs, why: str) -> None:
        """Count chunks as failed; the next chunk sent after them on their streamlet gets
        SEQ_RESET (the broker would otherwise wait for the missing sequences forever)."""
        gaps = self.gaps
        for c in cs:
            self.failed += c.records
            self.outstanding -= c.records
            self.buffered -= c.charged
            if c.seq > gaps.get(c.key, -1):
                gaps[c.key] = c.seq
            if c.reports is not None:
                self.delivery.settle(c, self.by_id[c.key[0]]["name"], why)
            else:
                self.delivery.failed_silently(c, why)
        self.space.notify_all()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        r, _ = await self.coordinator.call("producer_id", {}, timeout=self.request_timeout)
        self.producer_id = r["id"]
        task_status.started()
        while True:
            self._woken = False
            now = time.monotonic()
            with self.lock:
                self._seal_expired(now)
            next_retry = self._dispatch(now)
            deadline = min(next_retry, self.linger_q[0].deadline if self.linger_q else math.inf)
            with trio.move_on_after(max(0.0, deadline - time.monotonic())):
                await self._wake.wait()
            self._wake = trio.Event()

    def kick(self) -> None:
        """Seal every open chunk and wake the sender (what ``flush`` starts with)."""
        self.seal_all()
        self._wake.set()

    def check(self) -> None:
        """Raise ProduceError if records failed that no delivery report told of."""
        d = self.delivery
        if d.silent:
            raise ProduceError(f"{d.silent} records failed: {'; '.join(d.silent_why[:3])}")

    async def flush(self) -> None:
        """Wait until every record sent so far is acknowledged (or failed); raises ProduceError
        for failed records sent without a delivery callback."""
        self.kick()
        while self.outstanding > 0:
            await self._progress.wait()
        self.delivery.hand()
        self.check()


@asynccontextmanager
async def open_producer(coordinator: str | None = None, config: dict | None = None, on_delivery=None, **kw):
    """``async with open_producer(acks="all", linger_ms=1) as p: await p.send("s", b"v")``;
    ``on_delivery(error, report)``: the default delivery callback of ``send``."""
    cfg = _config(config, kw)
    async with unwrapped(), open_pool() as pool, trio.open_nursery() as nursery:
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
        cfg = _config(config, kw)
        async with open_pool() as pool:
            async with trio.open_nursery() as nursery:
                p = AsyncProducer(pool, nursery, coordinator or default_coordinator(), cfg,
                                  Deliveries(self._default, queued=True))
                await nursery.start(p.run)
                task_status.started(p)

    def _stream(self, name: str, value, key, cb) -> dict | None:
        s = self._p.streams.get(name)
        if s is None:
            try:
                self.portal.call(self._p.stream, name)
            except UnknownStream as e:
                if cb is None:
                    raise
                self._d.refused(name, key, value, cb, e)  # told by the next poll
                return None
            s = self._p.streams[name]
        return s

    def send(self, stream: str, value: bytes, key: bytes | None = None, timestamp: int | None = None,
             on_delivery=None) -> None:
        """Queue one record; first serve any delivery reports waiting. ``on_delivery(error,
        DeliveryReport)`` (default: the producer's) is called once with the record's outcome."""
        p = self._p
        if self._d.ready:
            self._d.serve()
        cb = on_delivery or self._default
        s = p.streams.get(stream) or self._stream(stream, value, key, cb)
        if s is None:
            return
        with p.lock:
            if p.buffered >= p.buffer_memory:
                p._wait_space()
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
