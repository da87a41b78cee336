"""Talking to kera from Spark's Python processes (driver planner and executors).

Each Python process keeps one trio loop in a background thread (``Portal``)
with one connection pool, reused by every task the worker runs. The driver
side asks the coordinator which streams match and the brokers where their
groups durably end (``offsets``); the executor side pulls a partition's
ranges from the owner brokers (one ``pull`` per broker per round, covering all
the partition's streamlets there) until every group reached its end position,
and turns what it got into Arrow batches.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from collections import deque

import trio

from kera import chunk as chunkfmt
from kera.coordinator.link import CoordinatorLink
from kera.errors import KeraError
from kera.limits import MAX_PULL_STREAMLETS
from kera.rpc import open_pool
from kera.security import client_config

from ..metadata import describe
from ..portal import Portal
from ..positions import GroupPositions
from .arrow import ChunkBatch
from .positions import DONE, Offsets, compact, order, pack, unpack

log = logging.getLogger("kera.spark")

RPC_TIMEOUT = 30.0


def security(options) -> tuple:
    """A query's security settings (``kera.security.client_config``'s names, or ``config``:
    a client.conf file), as a key: each set of settings has its own connections."""
    given = {k: str(v) for k, v in options.items() if k in client_config.KEYS}
    path = options.get("config")
    return tuple(sorted({**(client_config.read(path) if path else {}), **given}.items()))


class Runtime:
    """One trio loop + connection pool per process and security settings (created lazily,
    rebuilt after fork)."""

    _lock = threading.Lock()
    _current: dict[tuple, Runtime] = {}

    def __init__(self, settings: tuple = ()):
        self.pid = os.getpid()
        self.credentials = client_config.credentials(dict(settings))
        self.portal = Portal("kera-spark")
        self.pool = self.portal.start(self._serve)
        self.committers: dict[str, GroupPositions] = {}

    async def _serve(self, task_status):
        async with open_pool(credentials=self.credentials) as pool:
            task_status.started(pool)
            await trio.sleep_forever()

    @classmethod
    def get(cls, settings: tuple = ()) -> Runtime:
        with cls._lock:
            rt = cls._current.get(settings)
            if rt is None or rt.pid != os.getpid():
                rt = cls._current[settings] = Runtime(settings)
            return rt

    def run(self, afn, *args):
        return self.portal.call(afn, *args)

    def submit(self, afn, *args) -> concurrent.futures.Future:
        """Start ``afn(*args)`` in the loop now; its result is collected later."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        async def task():
            try:
                fut.set_result(await afn(*args))
            except Exception as e:
                fut.set_exception(e)

        self.portal.run_sync_soon(self.portal.nursery.start_soon, task)
        return fut

    def group_positions(self, coordinator: str) -> GroupPositions:
        """Where a query's consumer group commits (one per coordinator, kept with the pool)."""
        c = self.committers.get(coordinator)
        if c is None:
            c = self.committers[coordinator] = GroupPositions(self.pool, coordinator)
        return c

    def call(self, addr: str, method: str, meta: dict, timeout: float = RPC_TIMEOUT):
        async def go():
            return await self.pool.call(addr, method, meta, timeout=timeout)
        return self.portal.call(go)


# -- driver side: which streams, and where they end --------------------------------------

def metadata(coordinator: str, names=(), pattern: str | None = None, strict: bool = True,
             settings: tuple = ()) -> dict:
    """``{name: StreamView}`` of the named streams and those matching ``pattern`` (a page per
    request, ``kera_client.metadata``)."""
    rt = Runtime.get(settings)

    async def go():
        return await describe(CoordinatorLink(rt.pool, coordinator), names, pattern,
                              timeout=RPC_TIMEOUT, strict=strict)
    return rt.run(go)


def latest(meta: dict, coordinator: str | None = None, wait: float = 0.0,
           settings: tuple = ()) -> Offsets:
    """The durable end of every group of these streams (one ``offsets`` call per broker).

    With ``wait`` = 0, streamlets without a live owner (or being recovered)
    are left out: their positions simply do not move in this micro-batch.
    With ``wait`` > 0 (a starting point, an AvailableNow target, the end of a
    batch read: leaving a streamlet out would mean "from its beginning" or
    "nothing"), owners are looked up again until every streamlet answered,
    and past ``wait`` seconds it fails rather than answer incompletely.
    """
    rt = Runtime.get(settings)
    out = Offsets({n: s.id for n, s in meta.items()}, {})
    missing = {(n, i) for n, s in meta.items() for i in range(s.streamlets)}
    deadline = time.monotonic() + wait
    while True:
        by_addr: dict[str, list] = {}
        for n, i in missing:
            addr = meta[n].addrs[i]
            if addr is not None:
                by_addr.setdefault(addr, []).append([meta[n].id, i])
        by_id = {s.id: s.name for s in meta.values()}
        for r in rt.run(_offsets_all, rt.pool, by_addr):
            for sid, i, low, groups in r["offsets"]:
                name = by_id.get(sid)
                if name is not None:
                    out.positions[(name, i)] = compact(low, groups)
                    missing.discard((name, i))
        if not missing or wait <= 0:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"kera: no live owner answered for {len(missing)} streamlets within "
                               f"{wait:.0f} s (e.g. {', '.join(f'{n}/{i}' for n, i in sorted(missing)[:5])})")
        time.sleep(0.1)  # an owner is being recovered: poll again
        try:
            fresh = metadata(coordinator, sorted({n for n, _ in missing}), strict=False,
                             settings=settings)
        except KeraError as e:
            log.warning("metadata refresh failed: %s", e)
            continue
        for n in {n for n, _ in missing}:
            if n not in fresh or fresh[n].id != meta[n].id:
                raise RuntimeError(f"kera: stream {n} was deleted while being planned")
            meta[n] = fresh[n]


async def _offsets_all(pool, by_addr: dict) -> list[dict]:
    """Every broker's answers, ``MAX_PULL_STREAMLETS`` streamlets per request."""
    results = []

    async def one(addr, sls):
        try:
            r, _ = await pool.call(addr, "offsets", {"streamlets": sls}, timeout=RPC_TIMEOUT)
            results.append(r)
        except KeraError as e:
            log.warning("offsets from %s failed: %s", addr, e)
            pool.drop(addr)

    async with trio.open_nursery() as n:
        for addr, sls in by_addr.items():
            for k in range(0, len(sls), MAX_PULL_STREAMLETS):
                n.start_soon(one, addr, sls[k:k + MAX_PULL_STREAMLETS])
    return results


def align(meta: dict, cuts: list, settings: tuple = ()) -> dict[tuple, int | None]:
    """Move each cut's target to the first chunk boundary at or after it.

    One 1-byte pull per cut, from ``target - 1``: the broker answers with the
    bytes up to the end of the chunk holding that byte, so ``next`` is the
    boundary (``target`` itself if a chunk ends there); if the broker had to
    move to the next segment, that segment's start is the boundary. Cuts whose
    owner does not answer get None (the caller falls back to a segment start).
    """
    rt = Runtime.get(settings)
    out: dict[tuple, int | None] = {}

    async def one(c, limit):
        key = (c.stream, c.streamlet, c.group)
        s = meta.get(c.stream)
        addr = s.addrs[c.streamlet] if s else None
        seg, off = unpack(c.target)
        if addr is None or off == 0:
            out[key] = c.target if off == 0 else None
            return
        async with limit:
            try:
                r, _ = await rt.pool.call(addr, "pull", {
                    "streamlets": [[s.id, c.streamlet, c.group, {c.group: pack(seg, off - 1)}]],
                    "max_bytes": 1, "max_wait_ms": 0}, timeout=RPC_TIMEOUT)
            except KeraError as e:
                log.info("aligning a cut on %s failed: %s", addr, e)
                out[key] = None
                return
        got = None
        for sid, i, gid, eseg, eoff, n, nxt in r["entries"]:
            if (sid, i, gid) != (s.id, c.streamlet, c.group):
                continue
            if n and (eseg, eoff) == (seg, off - 1):
                got = nxt                      # the end of the chunk holding target - 1
            elif n:
                got = pack(eseg, eoff)         # the broker moved on to the next segment's start
            elif nxt == DONE or order(nxt) >= c.target:
                got = nxt
            break
        out[key] = got

    async def go():
        limit = trio.CapacityLimiter(64)
        async with trio.open_nursery() as n:
            for c in cuts:
                n.start_soon(one, c, limit)

    if cuts:
        rt.run(go)
    return out


# -- executor side: read ranges ----------------------------------------------------------

class _Range:
    """A streamlet range being read: per group [current position, end position]."""

    __slots__ = ("stream", "sid", "streamlet", "cur", "end")

    def __init__(self, wire):
        self.stream, self.sid, self.streamlet, groups, _ = wire
        self.cur = {g: s for g, s, e in groups}
        self.end = {g: e for g, s, e in groups}

    def pending(self) -> list[int]:
        return [g for g, c in self.cur.items() if order(c) < order(self.end[g])]

    def request(self) -> list:
        """The pull entry: our groups at their positions, every other group in between DONE
        (so the broker skips them and does not hold later groups of their slot back)."""
        gs = sorted(self.pending())
        pos = {g: DONE for g in range(gs[0], gs[-1] + 1)}
        for g in gs:
            pos[g] = self.cur[g]
        return [self.sid, self.streamlet, gs[0], pos]

    def absorb(self, gid: int, seg: int, off: int, nxt: int, buf, out: ChunkBatch | None) -> bool:
        """Take one pull entry; returns True if it moved the group forward."""
        cur = self.cur.get(gid)
        if cur is None:
            return False
        end = self.end[gid]
        if order(cur) >= order(end):
            return False
        base = pack(seg, off)
        if base < order(cur):
            raise RuntimeError(f"{self.stream}/{self.streamlet} group {gid}: broker answered "
                               f"from {base:#x}, behind {cur:#x}")
        cut = False
        if buf is not None and len(buf):
            for h, o in chunkfmt.scan(buf):
                p = pack(h.segment, h.offset)  # its placement: compacted chunks are not back to back
                if p >= order(end):
                    cut = True
                    break
                if h.stream_id != self.sid or h.streamlet != self.streamlet:
                    raise RuntimeError("a pulled chunk belongs to another streamlet")
                if out is not None:
                    out.add(self.stream, self.streamlet, gid, p, buf, o, h)
        new = end if cut or order(nxt) >= order(end) else nxt
        if new == cur:
            return False
        self.cur[gid] = new
        return True


class Stats:
    """What a partition read cost, for the statsFile option (one JSON line per task)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.outside = 0.0  # suspended at a yield: Spark consuming our batches
        self.pull = 0.0     # waiting for brokers
        self.decode = 0.0   # scanning chunks, bookkeeping, building Arrow
        self.pulls = 0
        self.records = 0
        self.bytes = 0

    def dump(self, path: str | None, ranges: int) -> None:
        if not path:
            return
        line = json.dumps({"pid": os.getpid(), "ranges": ranges, "records": self.records,
                           "bytes": self.bytes, "pulls": self.pulls, "pull_s": round(self.pull, 6),
                           "decode_s": round(self.decode, 6),
                           "source_s": round(time.perf_counter() - self.t0 - self.outside, 6),
                           "task_s": round(time.perf_counter() - self.t0, 6)})
        with open(path, "a") as f:
            f.write(line + "\n")


class _Reading:
    """What a task reading ranges keeps between rounds: the ranges of each streamlet still to
    read (in order), the owners' addresses, the batch being filled and the stats."""

    def __init__(self, coordinator: str, wires: list, addrs: dict, rt, pull_bytes: int, settings: tuple):
        self.coordinator, self.rt, self.pull_bytes, self.settings = coordinator, rt, pull_bytes, settings
        self.stats = Stats()
        self.queues: dict[tuple, deque] = {}
        for w in wires:
            r = _Range(w)
            if r.pending():
                self.queues.setdefault((r.sid, r.streamlet), deque()).append(r)
        self.addrs = {k: list(v) for k, v in addrs.items()}
        self.names = {w[1]: w[0] for w in wires}
        self.ids = {w[0]: w[1] for w in wires}
        self.batch = ChunkBatch()

    def active(self) -> dict:
        queues = self.queues
        for key in list(queues):
            q = queues[key]
            while q and not q[0].pending():
                q.popleft()
            if not q:
                del queues[key]
        return {k: q[0] for k, q in queues.items()}

    def refresh(self, stale_streams) -> None:
        """New owner addresses; streams deleted (or re-created) since planning are dropped."""
        try:
            meta = metadata(self.coordinator, sorted(stale_streams), strict=False, settings=self.settings)
        except KeraError as e:
            log.warning("metadata refresh failed: %s", e)
            return
        for name in stale_streams:
            s = meta.get(name)
            sid = self.ids.get(name)
            if s is None or s.id != sid:
                log.warning("stream %s was deleted while being read: its records are skipped", name)
                for key in [k for k in self.queues if k[0] == sid]:
                    del self.queues[key]
            else:
                self.addrs[name] = list(s.addrs)

    def plan_pull(self):
        """The next round: one request per broker, built here (the loop thread owns the ranges)."""
        cur = self.active()
        by_addr: dict[str, list] = {}
        reqs: dict[str, list] = {}
        stale = set()
        for (_sid, i), r in cur.items():
            a = self.addrs.get(r.stream, [None] * (i + 1))[i]
            if a is None:
                stale.add(r.stream)
            else:
                by_addr.setdefault(a, []).append(r)
                reqs.setdefault(a, []).append(r.request())
        fut = self.rt.submit(_pull_all, self.rt.pool, reqs, self.pull_bytes) if reqs else None
        return cur, by_addr, stale, fut

    def absorb(self, answers, cur: dict, by_addr: dict, stale: set) -> bool:
        """A round's answers into the batch; the streams whose owners refused or vanished
        join ``stale``. Whether any range moved."""
        moved = False
        for addr, r, payload in answers:
            if r is None:
                stale.update(x.stream for x in by_addr[addr])
                continue
            for e in r["errors"]:
                if e[0] in self.names:
                    stale.add(self.names[e[0]])
            at = 0
            for sid, i, gid, seg, off, n, nxt in r["entries"]:
                buf = payload[at:at + n] if n else None
                at += n
                rng = cur.get((sid, i))
                if rng is not None and rng.absorb(gid, seg, off, nxt, buf, self.batch):
                    moved = True
        return moved

    def emit(self):
        t = time.perf_counter()
        rb = self.batch.build()
        self.stats.records += rb.num_rows
        self.stats.bytes += self.batch.nbytes
        self.batch = ChunkBatch()
        self.stats.decode += time.perf_counter() - t
        return rb


def read_ranges(coordinator: str, wires: list, addrs: dict, *, pull_bytes: int = 8 << 20,
                batch_bytes: int = 8 << 20, timeout: float = 120.0, stats_file: str | None = None,
                settings: tuple = ()):
    """Yield RecordBatches of every record in ``wires`` (StreamletRange.to_wire tuples).

    ``addrs`` maps stream name to the owners' addresses as planned; they are
    refreshed from the coordinator when a broker refuses or disappears. A
    range that makes no progress for ``timeout`` seconds fails the task (Spark
    retries it; nothing is skipped silently).
    """
    rd = _Reading(coordinator, wires, addrs, Runtime.get(settings), pull_bytes, settings)
    stats = rd.stats
    last_progress = time.monotonic()
    try:
        cur, by_addr, stale, fut = rd.plan_pull()
        while cur:
            t = time.perf_counter()
            answers = fut.result() if fut is not None else []
            stats.pull += time.perf_counter() - t
            stats.pulls += len(by_addr)
            t = time.perf_counter()
            moved = rd.absorb(answers, cur, by_addr, stale)
            stats.decode += time.perf_counter() - t
            if moved:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > timeout:
                left = ", ".join(f"{r.stream}/{r.streamlet}" for r in rd.active().values())
                raise TimeoutError(f"kera: no progress for {timeout:.0f} s reading {left}")
            if stale:
                rd.refresh(stale)
                if not moved:
                    time.sleep(0.05)  # the owner is being recovered: ask again shortly
            # the next pull runs while this batch is built and handed to Spark
            cur, by_addr, stale, fut = rd.plan_pull()
            if rd.batch.nbytes >= batch_bytes or (not cur and len(rd.batch)):
                rb = rd.emit()
                t = time.perf_counter()
                yield rb
                stats.outside += time.perf_counter() - t
    finally:
        stats.dump(stats_file, len(wires))


async def _pull_all(pool, reqs: dict, pull_bytes: int) -> list:
    """One pull per broker (per ``MAX_PULL_STREAMLETS`` streamlets), all at once:
    ``[(addr, meta, payload)]``, meta None (and the error) for a pull that failed."""
    out = []

    async def one(addr, entries):
        try:
            r, payload = await pool.call(addr, "pull", {
                "streamlets": entries, "max_bytes": pull_bytes, "max_wait_ms": 200},
                timeout=RPC_TIMEOUT)
            out.append((addr, r, payload))
        except KeraError as e:
            log.info("pull from %s failed: %s", addr, e)
            pool.drop(addr)
            out.append((addr, None, e))

    async with trio.open_nursery() as n:
        for addr, entries in reqs.items():
            for k in range(0, len(entries), MAX_PULL_STREAMLETS):
                n.start_soon(one, addr, entries[k:k + MAX_PULL_STREAMLETS])
    return out


def sample_sizes(wires: list, addrs: dict, max_bytes: int = 1 << 20,
                 settings: tuple = ()) -> tuple[float, float] | None:
    """(bytes per record, bytes per chunk) over up to ``max_bytes`` of the given ranges."""
    seen_bytes = seen_records = seen_chunks = 0
    for w in wires:
        r = _Range(w)
        if not r.pending():
            continue
        a = addrs.get(r.stream, [None] * (r.streamlet + 1))[r.streamlet]
        if a is None:
            continue
        try:
            meta, payload = Runtime.get(settings).call(a, "pull", {
                "streamlets": [r.request()], "max_bytes": 256 << 10, "max_wait_ms": 0})
        except KeraError:
            continue
        at = 0
        for *_, n, _nxt in meta["entries"]:
            if n:
                for h, _ in chunkfmt.scan(payload[at:at + n], verify_bodies=False):
                    seen_bytes += h.size
                    seen_records += h.record_count
                    seen_chunks += 1
            at += n
        if seen_bytes >= max_bytes:
            break
    return (seen_bytes / seen_records, seen_bytes / seen_chunks) if seen_records else None
