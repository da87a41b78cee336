"""The producer's sending loop: waiting lanes -> requests, one per broker, and their answers.

``Sender.run`` is the producer's one loop task (trio, its nursery): each round
it seals the chunks whose linger is over, then ``_dispatch`` takes the lanes
waiting in the accumulator, broker by broker, into at most ``max.in.flight``
requests per broker of up to ``request.size`` bytes, a streamlet in at most one
request at a time. ``_settle`` settles each chunk of an answer: acknowledged,
back to the front of its lane to be retried in sequence order (``RETRIABLE``:
the owner moved, the broker died, a timeout), or given up on (``Accumulator.fail``),
which leaves a hole the next chunk of its streamlet closes with ``SEQ_RESET``.
Owners that moved are found again by ``_refresh``, with backoff while the
coordinator is away.

A broker cut off by a partition never answers and never fails the connection:
a request unanswered for ``CHECK_AFTER`` makes the producer ask the coordinator
where its streamlets live, and again every ``CHECK_AFTER`` while it waits; once
one of them has another owner, or none alive (its broker was declared dead), the
request is abandoned (``_abandon_moved``: its answer, if it ever comes, is
dropped with the connection) and its chunks are sent to the new owners as any
retry is: the same producer id and sequences, so a chunk the old broker made
durable before it was fenced is recovered once and taken as a duplicate.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import trio

from kera import chunk as chunkfmt
from kera.errors import RETRIABLE, KeraError, NotOwner, Unauthorized, UnknownProducer, UnknownStream
from kera.limits import MAX_REQUEST

from .accumulator import Accumulator, Outgoing, pack
from .admin import suspect
from .bulk import bulk
from .delivery import TIMEOUT, Deliveries
from .lanes import Buffer, Lane, Waker
from .lookups import Lookups

log = logging.getLogger("kera.producer")

REFRESH_MIN, REFRESH_MAX = 0.05, 2.0  # metadata refresh backoff, seconds
NO_OWNER_RETRY = 0.05   # seconds between looks at a streamlet without a live owner
RETRY_AFTER = 0.1       # seconds before chunks refused for a passing reason are sent again
# seconds a request waits for its answer before the producer asks whether its streamlets still
# live on that broker, and again each as long while it waits: under a broker's lease (0.75 of the
# coordinator's --dead-after, 1.5 s by default), so a silent broker costs the failure detector's
# time plus at most this, not the request timeout; a broker merely slow costs a metadata request
# per period, nothing more
CHECK_AFTER = 1.0


class ProduceError(KeraError):
    """Records failed that no delivery report told of (raised by ``flush``)."""

    code = "produce"


class Flight:
    """A request in flight: its broker, its lanes and the owner of each when it left, when to
    check them next, and the scope that abandons it."""

    __slots__ = ("addr", "lanes", "owners", "check_at", "scope")

    def __init__(self, addr: str, lanes: list[Lane], check_at: float):
        self.addr, self.lanes, self.check_at = addr, lanes, check_at
        self.owners = [lane.route.owners[lane.index] for lane in lanes]
        self.scope = trio.CancelScope()

    def moved(self) -> bool:
        """One of its streamlets has another owner now, or none alive."""
        addr = self.addr
        for lane, owner in zip(self.lanes, self.owners, strict=True):
            r, i = lane.route, lane.index
            if r.owners[i] != owner or r.addrs[i] != addr:
                return True
        return False


class Sender:
    """The producer's sending side, on its trio loop: it owns what is in flight (requests per
    broker, their flights) and the metadata refreshes; it takes chunks from the
    ``Accumulator``'s waiting lanes and gives them back (``release``, ``requeue``, ``fail``)."""

    def __init__(self, cfg: dict, pool, buffer: Buffer, delivery: Deliveries, acc: Accumulator,
                 lookups: Lookups, waker: Waker):
        self.acks = cfg["acks"]
        self.request_size = min(int(cfg["request.size"]), MAX_REQUEST)
        self.max_in_flight = int(cfg["max.in.flight"])
        self.delivery_timeout = cfg["delivery.timeout.ms"] / 1000
        self.request_timeout = cfg["request.timeout.ms"] / 1000
        self.pool, self.buffer, self.delivery, self.acc, self.lookups, self.waker = \
            pool, buffer, delivery, acc, lookups, waker
        self.nursery: trio.Nursery | None = None
        self.producer_id = 0
        self.producer_token = b""   # issued with the id: proves it is ours to the brokers
        self.inflight: dict[str, int] = {}
        self.flights: set[Flight] = set()
        self.stale: set[str] = set()           # streams whose owners to ask for again
        self.refresh_at = 0.0                  # no metadata refresh before this time
        self.refresh_backoff = REFRESH_MIN

    # -- the loop -----------------------------------------------------------------------------
    async def identify(self) -> None:
        """The producer's id (and its token), issued by the coordinator."""
        r, _ = await self.lookups.patient("producer_id", {})
        self.producer_id, self.producer_token = r["id"], r["token"]

    async def loop(self, nursery: trio.Nursery) -> None:
        """Rounds until cancelled: seal what lingered out, send, look up, sleep until woken."""
        self.nursery = nursery
        acc, waker = self.acc, self.waker
        while True:
            now = time.monotonic()
            with self.buffer.lock:
                acc.seal_expired(now)
            next_retry = min(self._dispatch(now), self.lookups.due(now))
            deadline = min(next_retry, acc.linger_q[0].deadline if acc.linger_q else math.inf)
            await waker.wait(deadline - time.monotonic())

    def _dispatch(self, now: float) -> float:
        """Start requests for brokers with waiting lanes; returns the next retry time."""
        next_retry = math.inf
        waiting = self.acc.waiting
        with self.buffer.lock:
            seen: set = set()
            while len(seen) < len(waiting):   # lanes that moved may wait under a new address
                for addr in [a for a in waiting if a not in seen]:
                    seen.add(addr)
                    q = waiting[addr]
                    if addr is None:
                        next_retry = min(next_retry, self._ownerless(q, now))
                    else:
                        while q and self.inflight.get(addr, 0) < self.max_in_flight:
                            items, lanes, t = self._take(addr, q, now)
                            next_retry = min(next_retry, t)
                            if not items:
                                break
                            self._start(addr, items, lanes, now)
                    if not q and waiting.get(addr) is q:
                        del waiting[addr]
                        seen.discard(addr)
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

    def _take(self, addr: str, q, now: float) -> tuple[list, list, float]:
        """Chunks for one request to ``addr``, from the lanes waiting there in turn: up to
        ``request.size`` bytes. Returns them, their lanes and the next retry time."""
        items: list[Outgoing] = []
        lanes: list[Lane] = []
        size, limit, t = 0, self.request_size, math.inf
        later = []
        acc = self.acc
        for _ in range(len(q)):
            lane = q[0]
            if lane.due is not None:
                acc.take_due(lane)
            chunks = lane.queue
            if size and chunks and size + chunks[0].size > limit:
                break   # the request is full: this lane goes first in the next one
            q.popleft()
            lane.waits = False
            if not chunks or lane.busy:
                continue
            if lane.retry_at > now:
                later.append(lane)
                t = min(t, lane.retry_at)
                continue
            if lane.route.addrs[lane.index] != addr:   # its owner moved: it waits there
                acc.rewait(lane)
                continue
            size = self._fill(lane, items, size, now)
            if lane.busy:
                lanes.append(lane)
            else:
                acc.rewait(lane)
            if size >= limit:
                break
        for lane in later:
            acc.rewait(lane)
        return items, lanes, t

    def _fill(self, lane: Lane, items: list, size: int, now: float) -> int:
        """Take ``lane``'s chunks into a request of ``size`` bytes so far, up to ``request.size``;
        chunks past ``delivery.timeout.ms`` are given up, the first after a hole is flagged
        ``SEQ_RESET``. Returns the new size (``lane.busy`` if any was taken)."""
        chunks, limit = lane.queue, self.request_size
        too_old = now - self.delivery_timeout
        k = 0
        for c in chunks:
            if size and size + c.size > limit:
                break
            k += 1
            if c.created < too_old:   # given up: the chunk after it starts a new base
                self.acc.fail([c], TIMEOUT)
                continue
            gap = lane.gap
            if gap is not None and c.seq > gap:  # the first chunk after a hole: a new base
                if c.data is None:
                    c.flags |= chunkfmt.SEQ_RESET
                else:
                    c.data, c.start = chunkfmt.with_flags(c.chunk(), chunkfmt.SEQ_RESET), 0
                lane.gap = None
            items.append(c)
            size += c.size
            lane.busy = True
        del chunks[:k]
        if not chunks:
            lane.queue = None   # most lanes send a chunk now and then: no list kept between
        return size

    def _ownerless(self, q, now: float) -> float:
        """Lanes whose streamlet has no live owner known: those that have one now wait under
        it; the others are looked up again (``stale``), chunks past their delivery timeout
        given up. Returns when to look again."""
        acc = self.acc
        for _ in range(len(q)):
            if q[0].due is not None:
                acc.take_due(q[0])
            lane = q.popleft()
            lane.waits = False
            if not lane.queue or lane.busy:
                continue
            r, chunks = lane.route, lane.queue
            if r.addrs[lane.index] is None:
                if self.lookups.streams.get(r.name) is not r:   # deleted, or re-created since
                    acc.fail(list(chunks), UnknownStream.code)
                    chunks.clear()
                    continue
                self.stale.add(r.name)
                k = 0
                while k < len(chunks) and now - chunks[k].created > self.delivery_timeout:
                    k += 1
                if k:
                    acc.fail(chunks[:k], TIMEOUT)
                    del chunks[:k]
            acc.rewait(lane)
        return now + NO_OWNER_RETRY if q else math.inf

    def _start(self, addr: str, items: list, lanes: list, now: float) -> None:
        self.inflight[addr] = self.inflight.get(addr, 0) + 1
        f = Flight(addr, lanes, now + CHECK_AFTER)
        self.flights.add(f)
        self.nursery.start_soon(self._request, f, items)

    def _check(self, now: float) -> float:
        """Requests waiting past their check time: their streams' owners are asked for again
        (``_refresh``, which then abandons those whose streamlets moved). Returns the next
        check time."""
        nearest = math.inf
        for f in self.flights:
            if f.check_at <= now:
                f.check_at = now + CHECK_AFTER
                self.stale.update(lane.route.name for lane in f.lanes)
            nearest = min(nearest, f.check_at)
        return nearest

    async def _refresh(self) -> None:
        """Metadata of streams whose owners moved; backs off while the coordinator is away.
        Requests one of whose streamlets has another owner now, or none alive (its broker
        declared dead), are abandoned: their chunks go to the new owners (``_request``)."""
        names, self.stale = self.stale, set()
        try:
            missing, refused = await self.lookups.reload(names)
            if missing:   # deleted: its chunks fail with the error, the others were loaded
                self.lookups.forget(set(missing))
            if refused:   # no longer this principal's to describe (an ACL gone): likewise
                self.lookups.forget(set(refused), Unauthorized.code)
            for f in self.flights:
                if f.moved():
                    f.scope.cancel()
            self.refresh_backoff = REFRESH_MIN
            self.refresh_at = 0.0
        except KeraError as e:
            if self.refresh_backoff == REFRESH_MIN:
                log.warning("metadata refresh failed (retrying with backoff): %s", e)
            self.stale |= names
            self.refresh_at = time.monotonic() + self.refresh_backoff
            self.refresh_backoff = min(self.refresh_backoff * 2, REFRESH_MAX)
        self.waker.set()

    # -- a request ----------------------------------------------------------------------------
    async def _request(self, flight: Flight, items: list) -> None:
        addr = flight.addr
        meta = {"producer": self.producer_id, "token": self.producer_token, "acks": self.acks}
        if self.delivery.used:   # where the chunks with delivery reports were placed
            want = [i for i, c in enumerate(items) if c.reports is not None]
            if want:
                meta["positions_of"] = np.array(want, "<u4").tobytes()
        where: dict = {}
        results = None
        try:
            with bulk():
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
            if results is None:   # abandoned (``Flight.moved``): the owners moved
                log.info("produce to %s abandoned: its streamlets live elsewhere now", addr)
                results = [NotOwner.code] * len(items)
                self.pool.drop(addr)
        except KeraError as e:
            log.info("produce to %s failed: %s", addr, e)
            results = [e.code] * len(items)
            self.pool.drop(addr)
            if e.code == "unavailable":
                self.nursery.start_soon(suspect, self.lookups.coordinator, addr)
        finally:
            self.flights.discard(flight)
        with self.buffer.lock, bulk():
            self.inflight[addr] -= 1
            self._settle(flight, items, results, where)
        self.delivery.hand()
        self.buffer.settled()
        self.waker.set()

    def _settle(self, flight: Flight, items: list, results: list, where: dict) -> None:
        """Each chunk of an answer: acknowledged, back to its lane (retried), or failed; then
        the request's lanes are released (lock held)."""
        now = time.monotonic()
        buf, acc, latency = self.buffer, self.acc, self.buffer.latencies.append
        retry: dict[Lane, list] = {}
        acked = charged = 0
        for i, (c, res) in enumerate(zip(items, results, strict=False)):
            if res is None:
                acked += c.records
                charged += c.charged
                latency(now - c.created)
                if c.reports is not None:
                    self.delivery.settle(c, c.lane.route.name, None, where.get(i))
            elif res in RETRIABLE:  # the chunks after a refused one come back out of order: retried
                lane = c.lane
                if res == UnknownProducer.code and c.seq > (-1 if lane.gap is None else lane.gap):
                    # the broker knows nothing of us here (a successor whose copy of what we
                    # wrote retention freed): what came before is settled, so a new base
                    lane.gap = c.seq - 1
                if c.data is not None and len(c.data) != c.size:
                    c.data, c.start = bytes(c.chunk()), 0   # keep its bytes, not its request's
                retry.setdefault(lane, []).append(c)
            else:
                acc.fail([c], res)
        buf.acked += acked
        buf.records -= acked
        buf.bytes -= charged
        for lane, cs in retry.items():
            acc.requeue(lane, cs, now + RETRY_AFTER)
            self.stale.add(lane.route.name)
        for lane in flight.lanes:
            acc.release(lane)
        buf.space.notify_all()
