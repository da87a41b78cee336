"""The producer's metadata: streams met for the first time are looked up together.

A record sent to a stream the producer does not know yet is *parked* (kept
with its callback, counted in ``buffer.memory`` and in what ``flush`` waits
for) and ``send`` returns at once: records to known streams go on meanwhile.
The first stream met starts a ``linger.ms`` wait, and every stream met before
it ends is asked in the same lookup (as librdkafka does): one ``metadata``
request per page (``kera_client.metadata``) for all of them, never one per
stream. When the answer comes, each stream's parked records join its chunks
in the order they were sent; those of unknown streams fail with
``UnknownStream``, and those of streams the producer may not describe with
``Unauthorized`` (their delivery report, or ``flush``), while the other streams
of the lookup go on. A lookup that fails
(the coordinator away) is tried again with backoff; parked records older
than ``delivery.timeout.ms`` then fail. Calls that need the stream itself
(``send_many``, ``send_columns``) wait for the lookup (``stream``), and they
and ``load_metadata`` wait for an unreachable coordinator up to
``delivery.timeout.ms`` too (``Sender._patient``).
"""

from __future__ import annotations

import logging
import math
import time

import trio

from kera import chunk as chunkfmt
from kera.errors import KeraError, RecordTooLarge, Unavailable, UnknownStream
from kera.limits import MAX_CHUNK

from .accumulator import check_record
from .delivery import TIMEOUT, error_for
from .metadata import fetch, refusal, unknown
from .stream_view import StreamView

log = logging.getLogger("kera.producer")

RETRY_MIN, RETRY_MAX = 0.05, 2.0   # a failed lookup is tried again after these, doubling
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
    ``delivery.timeout.ms`` (``Sender._patient``)."""

    __slots__ = ("producer",)

    def __init__(self, producer):
        self.producer = producer

    async def call(self, method: str, meta: dict, timeout: float | None = None):
        return await self.producer._patient(method, meta)


class Lookups:
    """``AsyncProducer``'s metadata side: ``streams`` (name -> ``StreamView``), ``by_id`` and
    ``room``, and the lookups that fill them. Shares the producer's lock and counters."""

    def __init__(self):
        self.streams: dict[str, StreamView] = {}
        self.by_id: dict[int, StreamView] = {}
        self.room: dict[int, int] = {}          # stream id -> record bytes one chunk holds
        self.parked: dict[str, list] = {}       # name -> [since, (value, key, timestamp, cb, n), ...]
        self.next_round = Round()               # the streams the next lookup asks for
        self.lookup_at = math.inf               # when it starts (a linger after the first)
        self.looking = False                    # one lookup at a time
        self.lookup_backoff = RETRY_MIN
        self.retry_after = 0.0                  # no lookup before this (a failed one's backoff)
        self.metadata_requests = 0              # metadata requests sent (one per page)

    def _known(self, s: StreamView) -> None:
        """Caller holds the lock."""
        old = self.streams.get(s.name)
        if old is not None and old.id != s.id:
            self.by_id.pop(old.id, None)
        self.streams[s.name] = s
        self.by_id[s.id] = s
        self.room[s.id] = chunkfmt.record_room(min(MAX_CHUNK, s.segment_size))

    async def _fetch(self, names, unpark: bool = False, patient: bool = False) -> tuple[list, list]:
        """The metadata of ``names``, a page per request (with ``unpark``, their parked records
        join their chunks as each page comes; ``patient``: waiting for an unreachable
        coordinator); returns the names that do not exist and those refused."""
        missing: list = []
        refused: list = []

        def take(streams, gone, denied):
            self.metadata_requests += 1
            with self.lock:
                for s in streams:
                    self._known(s)
                    if unpark:
                        self._unpark(s)
            missing.extend(gone)
            refused.extend(denied)

        await fetch(Patient(self) if patient else self.coordinator, names, on_page=take,
                    timeout=self.request_timeout)
        return missing, refused

    async def _load(self, names, patient: bool = False) -> None:
        """The metadata of ``names``, once the others are known: Unauthorized (``refused``)
        for those this principal may not describe, else UnknownStream (``missing``) for those
        that do not exist."""
        missing, refused = await self._fetch(names, patient=patient)
        if refused:
            raise refusal(refused)
        if missing:
            raise unknown(missing)

    async def load_metadata(self, names) -> None:
        """Fetch where many streams live up front (else they are looked up as they are met)."""
        await self._load([n for n in names if n not in self.streams], patient=True)

    async def stream(self, name: str) -> StreamView:
        """The stream's metadata, waiting for its lookup if need be (UnknownStream if none),
        and for an unreachable coordinator up to ``delivery.timeout.ms``."""
        deadline = time.monotonic() + self.delivery_timeout
        while True:
            s = self.streams.get(name)
            if s is not None:
                return s
            with self.lock:
                r = self._ask(name)
            await r.done.wait()
            if name in r.missing:
                raise unknown([name])
            if name in r.refused:
                raise refusal([name])
            if r.error is not None and name not in self.streams and (
                    not isinstance(r.error, Unavailable) or time.monotonic() >= deadline):
                raise r.error

    # -- parking (any thread, producer lock held) ---------------------------------------------
    def _ask(self, name: str) -> Round:
        r = self.next_round
        if name not in r.names:
            r.names[name] = None
            if self.lookup_at == math.inf:
                self.lookup_at = max(time.monotonic() + self.linger, self.retry_after)
                self._notify()
        return r

    def _park(self, name: str, value, key, timestamp, cb) -> None:
        """A record for a stream not known yet: kept until its lookup answers."""
        s = self.streams.get(name)
        if s is not None:   # known since the caller looked (another thread's lookup)
            self._append(s, value, key, timestamp, cb)
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
        held.append((value, key, timestamp, cb, n))
        self.buffered += n
        self.outstanding += 1

    # -- the lookup (the sender's loop) ------------------------------------------------------
    def _lookup_due(self, now: float) -> float:
        """Start the next lookup if it is due; returns when one is due next."""
        if self.looking or self.lookup_at == math.inf:
            return math.inf
        if now < self.lookup_at:
            return self.lookup_at
        self.looking = True
        with self.lock:
            r, self.next_round = self.next_round, Round()
            self.lookup_at = math.inf
        self.nursery.start_soon(self._lookup, r)
        return math.inf

    async def _lookup(self, r: Round) -> None:
        names = list(r.names)
        missing: list = []
        refused: list = []
        try:
            missing, refused = await self._fetch(names, unpark=True)
            self.lookup_backoff = RETRY_MIN
            self.retry_after = 0.0
        except KeraError as e:
            r.error = e
            if self.lookup_backoff == RETRY_MIN:
                log.warning("metadata lookup of %d streams failed (retrying with backoff): %s",
                            len(names), e)
            with self.lock:
                self.retry_after = time.monotonic() + self.lookup_backoff
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
            self.lookup_backoff = min(self.lookup_backoff * 2, RETRY_MAX)
        finally:
            self.looking = False
        if missing:
            r.missing = set(missing)
            err = unknown(missing)
            with self.lock:
                for n in missing:
                    self.streams.pop(n, None)
                    self._fail(n, err)
        if refused:   # those streams' records alone fail, each with its own refusal
            r.refused = set(refused)
            with self.lock:
                for n in refused:
                    self._fail(n, refusal([n]))
        r.done.set()
        self.delivery.hand()
        self._progress.set()   # a send waiting for buffer space looks again
        self._progress = trio.Event()
        self._wake.set()

    def _unpark(self, s: StreamView) -> None:
        """The records parked for ``s``, into its chunks in the order they were sent."""
        held = self.parked.pop(s.name, None)
        if held is None:
            return
        for value, key, timestamp, cb, n in held[1:]:
            self.buffered -= n
            self.outstanding -= 1
            try:
                self._append(s, value, key, timestamp, cb)
            except RecordTooLarge as e:   # sent without a callback: flush tells
                self._lost(1, e.code)

    def _fail(self, name: str, error: KeraError, why: str | None = None) -> None:
        """The records parked for ``name`` fail with ``error``."""
        held = self.parked.pop(name, None)
        for value, key, _ts, cb, n in (held or [None])[1:]:
            self.buffered -= n
            self.outstanding -= 1
            if cb is not None:
                self.failed += 1
                self.delivery.refused(name, key, value, cb, error)
            else:
                self._lost(1, why or error.code)
        self.space.notify_all()

    def _expire(self, names) -> None:
        """Records parked for longer than ``delivery.timeout.ms`` fail."""
        too_old = time.monotonic() - self.delivery_timeout
        for n in names:
            held = self.parked.get(n)
            if held is not None and held[0] < too_old:
                self._fail(n, error_for(TIMEOUT), TIMEOUT)

    def _lost(self, records: int, why: str) -> None:
        self.failed += records
        self.delivery.lost(records, why)

    def _forget(self, names: set, why: str = UnknownStream.code) -> None:
        """Streams that no longer exist (or that this principal may no longer describe): their
        queued chunks fail with ``why``."""
        with self.lock:
            for k in list(self.ready):
                s = self.by_id.get(k[0])
                if s is not None and s.name in names and k not in self.inflight_keys:
                    self._give_up(list(self.ready.pop(k)), why)
            for name in names:
                self.streams.pop(name, None)
        self.delivery.hand()
