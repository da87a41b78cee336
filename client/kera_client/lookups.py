"""The producer's metadata: streams met for the first time are looked up together.

A record sent to a stream the producer does not know yet is *parked* (kept
with its callback, counted in ``buffer.memory`` and in what ``flush`` waits
for) and ``send`` returns at once: records to known streams go on meanwhile.
The first stream met starts a ``linger.ms`` wait, and every stream met before
it ends is asked in the same lookup (as librdkafka does): one ``metadata``
request per page (``kera_client.metadata``) for all of them, never one per
stream. When the answer comes, each stream's parked records join its chunks
in the order they were sent (sealed at once if they lingered out while parked);
those of unknown streams fail with ``UnknownStream``, and those of streams the
producer may not describe with ``Unauthorized`` (their delivery report, or
``flush``), while the other streams of the lookup go on. A lookup that fails
(the coordinator away) is tried again with backoff; parked records older than
``delivery.timeout.ms`` then fail. Calls that need the stream itself
(``send_many``, ``send_columns``) wait for the lookup (``stream``), and they and
``load_metadata`` wait for an unreachable coordinator up to
``delivery.timeout.ms`` too (``patient``).
"""

from __future__ import annotations

import logging
import math
import time

import trio

from kera import chunk as chunkfmt
from kera.errors import KeraError, RecordTooLarge, Unavailable, UnknownStream
from kera.limits import MAX_CHUNK

from .accumulator import Accumulator, check_record
from .bulk import BIG_STEP, bulk, settled
from .delivery import TIMEOUT, Deliveries, error_for
from .lanes import Buffer, Route, Waker
from .metadata import fetch, refusal, unknown

log = logging.getLogger("kera.producer")

RETRY_MIN, RETRY_MAX = 0.05, 2.0   # a failed lookup or call is tried again after these, doubling
MAX_ROOM = chunkfmt.record_room(MAX_CHUNK)   # record bytes (16 + key + value) the largest chunk holds


class Round:
    """The streams of one lookup, and its outcome for those waiting on it."""

    __slots__ = ("names", "done", "missing", "refused", "error")

    def __init__(self):
        self.names: dict[str, None] = {}
        self.done = trio.Event()
        self.missing: set = set()
        self.refused: set = set()   # names this principal may not describe
        self.error: KeraError | None = None


class Patient:
    """The coordinator as ``fetch`` calls it, each call waiting while it is unreachable, up to
    ``delivery.timeout.ms`` (``Lookups.patient``)."""

    __slots__ = ("lookups",)

    def __init__(self, lookups):
        self.lookups = lookups

    async def call(self, method: str, meta: dict, timeout: float | None = None):
        return await self.lookups.patient(method, meta)


class Lookups:
    """The producer's metadata side: ``streams`` (name -> ``Route``) and ``by_id``, the parked
    records and the lookups that fill them. It hands the records it unparks to the
    ``Accumulator`` and counts them in the ``Buffer`` (under its lock)."""

    def __init__(self, cfg: dict, coordinator, buffer: Buffer, delivery: Deliveries,
                 acc: Accumulator, waker: Waker):
        self.coordinator = coordinator          # a CoordinatorLink
        self.linger = float(cfg["linger.ms"]) / 1000
        self.delivery_timeout = cfg["delivery.timeout.ms"] / 1000
        self.request_timeout = cfg["request.timeout.ms"] / 1000
        self.buffer, self.delivery, self.acc, self.waker = buffer, delivery, acc, waker
        self.nursery: trio.Nursery | None = None
        self.streams: dict[str, Route] = {}
        self.by_id: dict[int, Route] = {}
        self.parked: dict[str, list] = {}       # name -> [since, (value, key, timestamp, cb, n), ...]
        self.met = 0                            # streams parked since the last ``settled``
        self.next_round = Round()               # the streams the next lookup asks for
        self.lookup_at = math.inf               # when it starts (a linger after the first)
        self.looking = False                    # one lookup at a time
        self.backoff = RETRY_MIN
        self.retry_after = 0.0                  # no lookup before this (a failed one's backoff)
        self.requests = 0                       # metadata requests sent (one per page)

    # -- answers ------------------------------------------------------------------------------
    def _take(self, cols, unpark: bool) -> None:
        """A page of streams (``kera.meta_columns``): routes made or moved (caller holds the
        lock); with ``unpark``, their parked records join their chunks."""
        streams, by_id = self.streams, self.by_id
        addrs, owners = cols.routes()
        for name, sid, n, size, a, o in zip(cols.names, cols.ids.tolist(), cols.streamlets.tolist(),
                                             cols.segment_sizes.tolist(), addrs, owners, strict=True):
            r = streams.get(name)
            if r is not None and r.id == sid and r.streamlets == n:
                r.addrs, r.owners = a, o
            else:
                if r is not None:   # re-created under its name: the old one is served nowhere
                    r.gone()
                    by_id.pop(r.id, None)
                r = streams[name] = by_id[sid] = Route(name, sid, n, size, a, o)
            if unpark:
                held = self.parked.pop(name, None)
                if held is not None:
                    self._unpark(r, held)

    def _unpark(self, r: Route, held: list) -> None:
        """The records parked for ``r``, into its chunks in the order they were sent."""
        buf, append = self.buffer, self.acc.append
        if len(held) == 2:   # one record (most streams met for the first time): no generators
            value, key, timestamp, cb, size = held[1]
            plain, values = key is None and timestamp is None and cb is None, [value]
        else:
            plain = all(k is None and t is None and cb is None for _, k, t, cb, _ in held[1:])
            values = [rec[0] for rec in held[1:]] if plain else None
            size = sum(rec[4] for rec in held[1:])
        if plain:
            buf.bytes -= size
            buf.records -= len(values)
            if self.acc.add_sealed(r, values, size, held[0]):
                return
            buf.bytes += size
            buf.records += len(values)
        for value, key, timestamp, cb, n in held[1:]:
            buf.bytes -= n
            buf.records -= 1
            try:
                append(r, value, key, timestamp, cb)
            except RecordTooLarge as e:   # sent without a callback: flush tells
                self._lost(1, e.code)
        self.acc.seal_lingered(r, held[0])

    async def _fetch(self, names, unpark: bool = False, patient: bool = False) -> tuple[list, list]:
        """The metadata of ``names``, a page per request (with ``unpark``, their parked records
        join their chunks as each page comes; ``patient``: waiting for an unreachable
        coordinator); returns the names that do not exist and those refused."""
        missing: list = []
        refused: list = []

        def take(cols, gone, denied):
            self.requests += 1
            with self.buffer.lock, bulk():
                self._take(cols, unpark)
            settled(len(cols.names))
            missing.extend(gone)
            refused.extend(denied)

        await fetch(Patient(self) if patient else self.coordinator, names, on_page=take,
                    timeout=self.request_timeout)
        return missing, refused

    async def load(self, names, patient: bool = False) -> None:
        """The metadata of ``names``, once the others are known: Unauthorized (``refused``)
        for those this principal may not describe, else UnknownStream (``missing``) for those
        that do not exist."""
        missing, refused = await self._fetch(names, patient=patient)
        if refused:
            raise refusal(refused)
        if missing:
            raise unknown(missing)

    async def reload(self, names) -> tuple[list, list]:
        """The metadata of ``names`` again (owners moved): those that no longer exist and
        those this principal may no longer describe."""
        return await self._fetch(names)

    async def load_metadata(self, names) -> None:
        """Fetch where many streams live up front (else they are looked up as they are met)."""
        await self.load([n for n in names if n not in self.streams], patient=True)

    async def stream(self, name: str) -> Route:
        """The stream's route, waiting for its lookup if need be (UnknownStream if none), and
        for an unreachable coordinator up to ``delivery.timeout.ms``."""
        deadline = time.monotonic() + self.delivery_timeout
        while True:
            r = self.streams.get(name)
            if r is not None:
                return r
            with self.buffer.lock:
                rnd = self._ask(name)
            await rnd.done.wait()
            if name in rnd.missing:
                raise unknown([name])
            if name in rnd.refused:
                raise refusal([name])
            if rnd.error is not None and name not in self.streams and (
                    not isinstance(rnd.error, Unavailable) or time.monotonic() >= deadline):
                raise rnd.error

    async def patient(self, method: str, meta: dict):
        """A call to the coordinator, retried with backoff while it is unreachable or not
        serving (``unavailable``), up to ``delivery.timeout.ms``."""
        deadline = time.monotonic() + self.delivery_timeout
        delay = RETRY_MIN
        while True:
            try:
                return await self.coordinator.call(
                    method, meta, timeout=max(0.001, min(self.request_timeout, deadline - time.monotonic())))
            except Unavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if delay == RETRY_MIN:
                    log.warning("%s: coordinator unavailable (retrying for %.0f s more): %s", method, left, e)
                await trio.sleep(min(delay, left))
                delay = min(delay * 2, RETRY_MAX)

    # -- parking (any thread, the lock held) --------------------------------------------------
    def _ask(self, name: str) -> Round:
        r = self.next_round
        if name not in r.names:
            r.names[name] = None
            if self.lookup_at == math.inf:
                self.lookup_at = max(time.monotonic() + self.linger, self.retry_after)
                self.waker.notify()
        return r

    def park(self, name: str, value, key, timestamp, cb) -> None:
        """A record for a stream not known yet: kept until its lookup answers."""
        r = self.streams.get(name)
        if r is not None:   # known since the caller looked (another thread's lookup)
            self.acc.append(r, value, key, timestamp, cb)
            return
        check_record(value, key, timestamp)
        n = len(value) + 16 if key is None else len(value) + len(key) + 16
        if n > MAX_ROOM:   # no stream's chunk holds it, whatever its segment size
            err = RecordTooLarge(f"a record of {n - 16} bytes (key and value) exceeds what a chunk "
                                 f"holds (MAX_CHUNK, {MAX_CHUNK})", limit="MAX_CHUNK",
                                 bound=MAX_CHUNK, size=chunkfmt.chunk_size(1, n - 16))
            if cb is None:
                raise err
            self.delivery.refused(name, key, value, cb, err)
            return
        held = self.parked.get(name)
        if held is None:
            held = self.parked[name] = [time.monotonic()]
            self._ask(name)
            self.met += 1
            if self.met == BIG_STEP:   # streams met by the thousand: a big client (``bulk``)
                self.met = 0
                settled(BIG_STEP)
        held.append((value, key, timestamp, cb, n))
        self.buffer.bytes += n
        self.buffer.records += 1

    # -- the lookup (the sender's loop) ------------------------------------------------------
    def due(self, now: float) -> float:
        """Start the next lookup if it is due; returns when one is due next."""
        if self.looking or self.lookup_at == math.inf:
            return math.inf
        if now < self.lookup_at:
            return self.lookup_at
        self.looking = True
        with self.buffer.lock:
            r, self.next_round = self.next_round, Round()
            self.lookup_at = math.inf
        self.nursery.start_soon(self._lookup, r)
        return math.inf

    def hurry(self) -> None:
        """The streams met so far are looked up without waiting out the linger (``flush``)."""
        with self.buffer.lock:
            if self.lookup_at != math.inf:
                self.lookup_at = 0.0

    async def _lookup(self, r: Round) -> None:
        names = list(r.names)
        missing: list = []
        refused: list = []
        try:
            missing, refused = await self._fetch(names, unpark=True)
            self.backoff = RETRY_MIN
            self.retry_after = 0.0
        except KeraError as e:
            r.error = e
            self._failed(names, e)
        finally:
            self.looking = False
        if missing:
            r.missing = set(missing)
            err = unknown(missing)
            with self.buffer.lock:
                for n in missing:
                    self.streams.pop(n, None)
                    self._fail(n, err)
        if refused:   # those streams' records alone fail, each with its own refusal
            r.refused = set(refused)
            with self.buffer.lock:
                for n in refused:
                    self._fail(n, refusal([n]))
        r.done.set()
        self.delivery.hand()
        self.buffer.settled()   # a send waiting for buffer space looks again
        self.waker.set()

    def _failed(self, names: list, e: KeraError) -> None:
        """A lookup failed: asked again after a backoff (refused for good: its records fail)."""
        if self.backoff == RETRY_MIN:
            log.warning("metadata lookup of %d streams failed (retrying with backoff): %s",
                        len(names), e)
        with self.buffer.lock:
            self.retry_after = time.monotonic() + self.backoff
            left = [n for n in names if n not in self.streams]
            if not e.retriable:   # refused (an ACL, a bad name): asking again changes nothing
                for n in left:
                    self._fail(n, e)
            self._expire(left)
            for n in left:
                if n in self.parked:
                    self._ask(n)
            if self.lookup_at != math.inf:
                self.lookup_at = max(self.lookup_at, self.retry_after)
        self.backoff = min(self.backoff * 2, RETRY_MAX)

    def _fail(self, name: str, error: KeraError, why: str | None = None) -> None:
        """The records parked for ``name`` fail with ``error``."""
        held = self.parked.pop(name, None)
        buf = self.buffer
        for value, key, _ts, cb, n in (held or [None])[1:]:
            buf.bytes -= n
            buf.records -= 1
            if cb is not None:
                buf.failed += 1
                self.delivery.refused(name, key, value, cb, error)
            else:
                self._lost(1, why or error.code)
        buf.space.notify_all()

    def _expire(self, names) -> None:
        """Records parked for longer than ``delivery.timeout.ms`` fail."""
        too_old = time.monotonic() - self.delivery_timeout
        for n in names:
            held = self.parked.get(n)
            if held is not None and held[0] < too_old:
                self._fail(n, error_for(TIMEOUT), TIMEOUT)

    def _lost(self, records: int, why: str) -> None:
        self.buffer.failed += records
        self.delivery.lost(records, why)

    def forget(self, names: set, why: str = UnknownStream.code) -> None:
        """Streams that no longer exist (or that this principal may no longer describe): their
        queued chunks fail with ``why`` (those in a request come back and fail as answered)."""
        with self.buffer.lock:
            for name in names:
                r = self.streams.pop(name, None)
                if r is None:
                    continue
                self.by_id.pop(r.id, None)
                r.gone()
                for lane in r.lanes:
                    if lane is not None and lane.queue and not lane.busy:
                        chunks = list(lane.queue)
                        lane.queue.clear()
                        self.acc.fail(chunks, why)
        self.delivery.hand()
