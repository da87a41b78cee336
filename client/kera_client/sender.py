"""The producer's sending loop: sealed chunks -> requests, one per broker, and their answers.

``Sender.run`` is the ``AsyncProducer``'s one loop task (trio, its nursery):
each round it seals the chunks whose linger is over, then ``_dispatch`` takes
chunks from ``ready`` into at most ``max.in.flight`` requests per broker of up
to ``request.size`` bytes, a streamlet in at most one request at a time.
``_request`` settles each chunk of an answer: acknowledged, back to the front
of its queue to be retried in sequence order (``RETRIABLE``: the owner moved,
the broker died, a timeout), or given up on (``_give_up``), which leaves a hole
the next chunk of its streamlet closes with ``SEQ_RESET``. Owners that moved
are found again by ``_refresh``, with backoff while the coordinator is away.

A broker cut off by a partition never answers and never fails the connection:
a request unanswered for ``CHECK_AFTER`` makes the producer ask the coordinator
where its streamlets live, and again every ``CHECK_AFTER`` while it waits; once
one of them has another owner, or none alive (its broker was declared dead), the
request is abandoned (``_abandon_moved``: its answer, if it ever comes, is
dropped with the connection) and its chunks are sent to the new owners as any
retry is: the same producer id and sequences, so a chunk the old broker made
durable before it was fenced is recovered once and taken as a duplicate.
Calls to the coordinator a producer cannot do without (its id, the metadata of
the streams it is asked to write) wait for it while it is unreachable, up to
``delivery.timeout.ms`` (``_patient``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import trio

from kera import chunk as chunkfmt
from kera.errors import (
    KeraError,
    NotOwner,
    Unauthorized,
    Unavailable,
    UnknownProducer,
)
from kera.limits import MAX_REQUEST

from .accumulator import pack
from .admin import suspect
from .delivery import TIMEOUT

log = logging.getLogger("kera.producer")

REFRESH_MIN, REFRESH_MAX = 0.05, 2.0  # metadata refresh backoff, seconds
# seconds a request waits for its answer before the producer asks whether its streamlets still
# live on that broker, and again each as long while it waits: under a broker's lease (0.75 of the
# coordinator's --dead-after, 1.5 s by default), so a silent broker costs the failure detector's
# time plus at most this, not the request timeout; a broker merely slow costs a metadata request
# per period, nothing more
CHECK_AFTER = 1.0

RETRIABLE = {"not_owner", "recovering", "fenced", "out_of_order_sequence", "unavailable",
             "not_enough_backups", "backup", "internal", "unknown_producer"}


class ProduceError(KeraError):
    """Records failed that no delivery report told of (raised by ``flush``)."""

    code = "produce"


class Flight:
    """A request in flight: its broker, the owner of each of its streamlets when it left, when
    to check them next, and the scope that abandons it."""

    __slots__ = ("addr", "owners", "check_at", "scope")

    def __init__(self, addr: str, owners: dict, check_at: float):
        self.addr, self.owners, self.check_at = addr, owners, check_at
        self.scope = trio.CancelScope()


class Sender:
    """``AsyncProducer``'s sending side, on its trio loop: it owns what is in flight, the
    holes to reset and the acknowledged / failed counts, and shares with the accumulating
    side (set up by the producer) ``lock``, ``ready``, ``buffered``, ``outstanding``,
    ``delivery`` and the wake-up events."""

    def __init__(self, cfg: dict):
        self.acks = cfg["acks"]
        self.request_size = min(int(cfg["request.size"]), MAX_REQUEST)
        self.max_in_flight = int(cfg["max.in.flight"])
        self.delivery_timeout = cfg["delivery.timeout.ms"] / 1000
        self.request_timeout = cfg["request.timeout.ms"] / 1000
        self.gaps: dict[tuple, int] = {}       # streamlet -> highest sequence given up, not yet reset
        self.inflight_keys: set = set()
        self.inflight: dict[str, int] = {}
        self.flights: set[Flight] = set()
        self.retry_at: dict[tuple, float] = {}
        self.stale: set[str] = set()
        self.refresh_at = 0.0                  # no metadata refresh before this time
        self.refresh_backoff = REFRESH_MIN
        self.acked = 0           # records acknowledged
        self.failed = 0          # records given up on
        self.latencies: deque = deque(maxlen=100_000)  # seconds, a chunk's first record -> ack

    def _dispatch(self, now: float) -> float:
        """Start requests for brokers with ready chunks; returns the next retry time."""
        next_retry = math.inf
        plans: dict[str, list] = {}
        sizes: dict[str, int] = {}
        ready, busy, retry_at, gaps = self.ready, self.inflight_keys, self.retry_at, self.gaps
        limit, too_old = self.request_size, now - self.delivery_timeout
        with self.lock:
            for k in list(ready):
                q = ready[k]
                if not q:
                    del ready[k]
                    continue
                if k in busy:
                    continue
                t = retry_at.get(k, 0) if retry_at else 0
                if t > now:
                    next_retry = min(next_retry, t)
                    continue
                s = self.by_id.get(k[0])
                addr = s.addrs[k[1]] if s is not None else None
                if addr is None:
                    if s is not None:
                        self.stale.add(s.name)
                    while q and now - q[0].created > self.delivery_timeout:  # no owner for too long
                        self._give_up([q.popleft()], TIMEOUT)
                    self.retry_at[k] = now + 0.05
                    next_retry = min(next_retry, now + 0.05)
                    continue
                if self.inflight.get(addr, 0) >= self.max_in_flight:
                    continue
                size = sizes.get(addr, 0)
                if size >= limit:
                    continue
                items = plans.get(addr)
                if items is None:
                    items = plans[addr] = []
                taken = len(items)
                gap = gaps.get(k) if gaps else None
                while q and (size == 0 or size + q[0].size <= limit):
                    c = q.popleft()
                    if c.created < too_old:
                        self._give_up([c], TIMEOUT)
                        gap = gaps[k]
                        continue
                    if gap is not None and c.seq > gap:  # the first chunk after a hole: a new base
                        if c.data is None:
                            c.flags |= chunkfmt.SEQ_RESET
                        else:
                            c.data, c.start = chunkfmt.with_flags(c.chunk(), chunkfmt.SEQ_RESET), 0
                        del gaps[k]
                        gap = None
                    items.append(c)
                    size += c.size
                sizes[addr] = size
                if len(items) > taken:
                    busy.add(k)
                if not q:
                    del ready[k]
                elif len(items) > taken:
                    # served: to the back, so the streamlets after it go first next time (else,
                    # with a deep buffer, the first ones in the dict always fill the requests
                    # and the others' records wait, and age, in the buffer)
                    ready[k] = ready.pop(k)
            for addr, items in plans.items():
                if items:
                    self.inflight[addr] = self.inflight.get(addr, 0) + 1
                    by_id = self.by_id
                    f = Flight(addr, {c.key: by_id[c.key[0]].owners[c.key[1]] for c in items},
                               now + CHECK_AFTER)
                    self.flights.add(f)
                    self.nursery.start_soon(self._request, f, items)
            if self.flights:
                next_retry = min(next_retry, self._check(now))
        if self.delivery.ready:
            self.delivery.hand()
        if self.stale:
            if now >= self.refresh_at:
                self.refresh_at = math.inf  # one refresh at a time
                self.nursery.start_soon(self._refresh)
            else:
                next_retry = min(next_retry, self.refresh_at)
        return next_retry

    def _check(self, now: float) -> float:
        """Requests waiting past their check time: their streams' owners are asked for again
        (``_refresh``, which then abandons those whose streamlets moved). Returns the next
        check time."""
        nearest = math.inf
        for f in self.flights:
            if f.check_at <= now:
                f.check_at = now + CHECK_AFTER
                self.stale.update(self.by_id[k[0]].name for k in f.owners if k[0] in self.by_id)
            nearest = min(nearest, f.check_at)
        return nearest

    def _abandon_moved(self) -> None:
        """Abandon every request one of whose streamlets has another owner now, or none alive
        (its broker declared dead): its chunks go to the new owners (``_request``)."""
        for f in self.flights:
            for k, owner in f.owners.items():
                s = self.by_id.get(k[0])
                if s is None or s.owners[k[1]] != owner or s.addrs[k[1]] != f.addr:
                    f.scope.cancel()
                    break

    async def _refresh(self) -> None:
        """Metadata of streams whose owners moved; backs off while the coordinator is away."""
        names, self.stale = self.stale, set()
        try:
            missing, refused = await self._fetch(names)
            if missing:   # deleted: its chunks fail with the error, the others were loaded
                self._forget(set(missing))
            if refused:   # no longer this principal's to describe (an ACL gone): likewise
                self._forget(set(refused), Unauthorized.code)
            self._abandon_moved()
            self.refresh_backoff = REFRESH_MIN
            self.refresh_at = 0.0
        except KeraError as e:
            if self.refresh_backoff == REFRESH_MIN:
                log.warning("metadata refresh failed (retrying with backoff): %s", e)
            self.stale |= names
            self.refresh_at = time.monotonic() + self.refresh_backoff
            self.refresh_backoff = min(self.refresh_backoff * 2, REFRESH_MAX)
        self._wake.set()

    async def _request(self, flight: Flight, items: list) -> None:
        addr = flight.addr
        meta = {"producer": self.producer_id, "token": self.producer_token, "acks": self.acks}
        if self.delivery.used and any(c.reports is not None for c in items):
            meta["positions"] = True  # where each chunk was placed, for its delivery reports
        where = {}
        results = None
        try:
            whole = pack(items, self.producer_id)
            with flight.scope:
                r, _ = await self.pool.call(addr, "produce", meta,
                                            parts=[whole] if whole is not None else [c.chunk() for c in items],
                                            timeout=self.request_timeout)
                results = [None] * len(items)  # the broker names only the chunks it refused
                for i, code in r["errors"]:
                    results[i] = code
                for i, g, seg, off in r.get("placed") or ():
                    where[i] = (g, seg, off)
            if results is None:   # abandoned (``_abandon_moved``): the owners moved
                log.info("produce to %s abandoned: its streamlets live elsewhere now", addr)
                results = [NotOwner.code] * len(items)
                self.pool.drop(addr)
        except KeraError as e:
            log.info("produce to %s failed: %s", addr, e)
            results = [e.code] * len(items)
            self.pool.drop(addr)
            if e.code == "unavailable":
                self.nursery.start_soon(suspect, self.coordinator, addr)
        finally:
            self.flights.discard(flight)
        now = time.monotonic()
        with self.lock:
            self.inflight[addr] -= 1
            retry: dict[tuple, list] = {}
            busy, due, latency = self.inflight_keys, self.due, self.latencies.append
            acked = charged = 0
            for i, (c, res) in enumerate(zip(items, results, strict=False)):
                busy.discard(c.key)
                if due:
                    self._release(c.key)
                if res is None:
                    acked += c.records
                    charged += c.charged
                    latency(now - c.created)
                    if c.reports is not None:
                        self.delivery.settle(c, self.by_id[c.key[0]].name, None, where.get(i))
                elif res in RETRIABLE:  # the chunks after a refused one come back out of order: retried
                    if res == UnknownProducer.code and c.seq > self.gaps.get(c.key, -1):
                        # the broker knows nothing of us here (a successor whose copy of what we
                        # wrote retention freed): what came before is settled, so a new base
                        self.gaps[c.key] = c.seq - 1
                    if c.data is not None and len(c.data) != c.size:
                        c.data, c.start = bytes(c.chunk()), 0   # keep its bytes, not its request's
                    retry.setdefault(c.key, []).append(c)
                else:
                    self._give_up([c], res)
            self.acked += acked
            self.outstanding -= acked
            self.buffered -= charged
            for k, cs in retry.items():
                q = self.ready.setdefault(k, deque())
                q.extendleft(reversed(cs))
                self.retry_at[k] = now + 0.1
                s = self.by_id.get(k[0])
                if s is not None:
                    self.stale.add(s.name)
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
                self.delivery.settle(c, self.by_id[c.key[0]].name, why)
            else:
                self.delivery.failed_silently(c, why)
        self.space.notify_all()

    async def _patient(self, method: str, meta: dict):
        """A call to the coordinator, retried with backoff while it is unreachable or not
        serving (``unavailable``), up to ``delivery.timeout.ms``."""
        deadline = time.monotonic() + self.delivery_timeout
        delay = REFRESH_MIN
        while True:
            try:
                return await self.coordinator.call(
                    method, meta, timeout=max(0.001, min(self.request_timeout, deadline - time.monotonic())))
            except Unavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if delay == REFRESH_MIN:
                    log.warning("%s: coordinator unavailable (retrying for %.0f s more): %s", method, left, e)
                await trio.sleep(min(delay, left))
                delay = min(delay * 2, REFRESH_MAX)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        r, _ = await self._patient("producer_id", {})
        self.producer_id, self.producer_token = r["id"], r["token"]
        task_status.started()
        while True:
            self._woken = False
            now = time.monotonic()
            with self.lock:
                self._seal_expired(now)
            next_retry = min(self._dispatch(now), self._lookup_due(now))
            deadline = min(next_retry, self.linger_q[0].deadline if self.linger_q else math.inf)
            with trio.move_on_after(max(0.0, deadline - time.monotonic())):
                await self._wake.wait()
            self._wake = trio.Event()

    def kick(self) -> None:
        """Seal every open chunk, look up the streams met without waiting out the linger, and
        wake the sender (what ``flush`` starts with)."""
        self.seal_all()
        with self.lock:
            if self.lookup_at != math.inf:
                self.lookup_at = 0.0
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

