"""Replication of a broker's virtual logs: ``REPLICATE_INFLIGHT`` replicate RPCs in flight per backup.

Each ``Replicator`` is one pure ``VirtualLog`` with what producers wait on. The
broker's ``ReplicationHub`` drives them all with trio and the RPC pool: each
round it polls every vlog with work for the copies whose backup has room for
another RPC in flight, and sends each such backup one ``replicate`` carrying the new bytes of
all of them (group commit across vlogs: the RPCs follow the backups, not the
vlogs or the streams). Each entry's answer goes to its own vlog as if it had
been sent alone; a lost connection or a timeout fails every entry of its RPC.
The vlogs decide what to send and what an answer means. An RPC that can leave
at once on the backup's open connection is posted: no task waits for it, its
answer comes back from the connection's reader and the hub times it out. The
other RPCs and the trims run in the hub's nursery, so an incarnation's end
cancels them all; the posted ones' answers are then dropped.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from functools import partial

import trio

from ..errors import Fenced, KeraError, ProtocolError, Unavailable, from_wire
from ..limits import REPLICATE_ENTRIES, REPLICATE_INFLIGHT, REPLICATE_RPC
from ..rpc import Pool
from ..vlog import VirtualLog
from ..vlog.virtual_log import Send

log = logging.getLogger("kera.vlog")


def rpc_batches(sizes: list[int], max_bytes: int = REPLICATE_RPC,
                max_entries: int = REPLICATE_ENTRIES) -> list[tuple[int, int]]:
    """Consecutive [i, j) ranges of entries (of ``sizes`` bytes) for one backup, one RPC each:
    up to ``max_entries`` entries and ``max_bytes`` bytes, or one entry if it alone is larger."""
    out, i = [], 0
    while i < len(sizes):
        j, total = i + 1, sizes[i]
        while j < len(sizes) and j - i < max_entries and total + sizes[j] <= max_bytes:
            total += sizes[j]
            j += 1
        out.append((i, j))
        i = j
    return out


class ReplicationHub:
    """A broker incarnation's replication task: every vlog's copies, one RPC per backup."""

    def __init__(self, pool: Pool, identity: Callable[[], tuple[int, int]],
                 addr_of: Callable[[int], str], timeout: float):
        self.pool = pool
        self.identity = identity      # (broker id, epoch) named in every replicate
        self.addr_of = addr_of        # backup id -> address
        self.timeout = timeout
        self.vlogs: list[Replicator] = []
        self.out: dict[int, int] = {}  # backup -> replicate RPCs in flight to it
        self.busy: set[int] = set()   # backups with ``REPLICATE_INFLIGHT`` of them
        self.posted: dict[int, tuple] = {}  # key -> (deadline, connection, request id, backup, batch)
        self._keys = 0
        self.wake = trio.Event()
        self.appended = False         # chunks were appended since the last round began
        self.rpcs = 0                 # replicate RPCs sent
        self.entries = 0              # vseg copies they carried
        self.bytes = 0

    def add(self, r: Replicator) -> None:
        self.vlogs.append(r)
        self.wake.set()

    def stats(self) -> dict:
        return {"rpcs": self.rpcs, "entries": self.entries, "bytes": self.bytes,
                "backups_busy": len(self.busy), "in_flight": sum(self.out.values())}

    async def run(self) -> None:
        try:
            await self._rounds()
        finally:  # the incarnation ended: answers to its posted RPCs are dropped, as its tasks are
            for _, conn, rid, _, _ in list(self.posted.values()):
                conn.forget(rid)
            self.posted.clear()
            ended = Fenced("this broker incarnation ended before the chunks were durable")
            for r in self.vlogs:
                r.fail_waiters(ended)

    async def _rounds(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                self.wake = trio.Event()
                if self.appended:  # let requests already received append too: they leave in this round
                    self.appended = False
                    await trio.sleep(0)
                now = trio.current_time()
                out: dict[int, list[tuple[Replicator, Send]]] = {}
                deadline = math.inf
                for r in self.vlogs:
                    v = r.log
                    if v.floor > r.trimmed and not r.trimming:
                        r.trimming = True
                        nursery.start_soon(r.trim)
                    if not (v.active or r.poked):
                        continue  # idle: nothing to send, no timer
                    r.poked = False
                    for s in v.poll(now, self.busy):
                        out.setdefault(s.backup, []).append((r, s))
                    if v.fenced:
                        raise Fenced(f"vlog {v.id}: a backup says this incarnation is fenced")
                    d = v.next_deadline(now)
                    if d is not None:
                        deadline = min(deadline, d)
                made: dict = {}   # a vseg range's parts, sliced once for all its backups
                for backup, sends in out.items():
                    self._taken(backup)
                    if not self._post(backup, sends, now, made):
                        nursery.start_soon(self._send, backup, sends)
                for key, (t, conn, rid, backup, batch) in list(self.posted.items()):
                    if t <= now:
                        conn.forget(rid, timed_out=True)
                        self._done(key, backup, batch, Unavailable(
                            f"replicate to {conn.addr} timed out after {self.timeout} s"))
                    else:
                        deadline = min(deadline, t)
                if deadline == math.inf:
                    await self.wake.wait()
                else:
                    with trio.move_on_at(deadline):
                        await self.wake.wait()

    def _taken(self, backup: int) -> None:
        n = self.out[backup] = self.out.get(backup, 0) + 1
        if n >= REPLICATE_INFLIGHT:
            self.busy.add(backup)

    def _freed(self, backup: int) -> None:
        n = self.out[backup] = self.out[backup] - 1
        if n < REPLICATE_INFLIGHT:
            self.busy.discard(backup)
        self.wake.set()

    def _post(self, backup: int, sends: list[tuple[Replicator, Send]], now: float,
              made: dict | None = None) -> bool:
        """Send the one RPC ``sends`` make without a task, if the backup's connection is open
        and free: its answer comes back through ``_done``, from the connection's reader.
        ``made``: the parts of the vseg ranges already sliced this round (``_request``)."""
        sizes = [s.end - s.offset for _, s in sends]
        if len(rpc_batches(sizes)) > 1:
            return False  # ``_send`` sends them one RPC after the other
        try:
            conn = self.pool.conns.get(self.addr_of(backup))
        except KeraError:
            return False  # ``_send`` reports it
        if conn is None:
            return False
        meta, parts = self._request(sends, sum(sizes), made)
        self._keys += 1
        key = self._keys
        rid = conn.post("replicate", meta, partial(self._done, key, backup, sends), parts=parts)
        if rid is None:
            self.rpcs -= 1  # not sent: ``_send`` sends it
            self.entries -= len(sends)
            self.bytes -= sum(sizes)
            return False
        self.posted[key] = (now + self.timeout, conn, rid, backup, sends)
        return True

    def _done(self, key: int, backup: int, batch: list[tuple[Replicator, Send]], answer) -> None:
        """A posted RPC's answer (or failure, or timeout)."""
        if self.posted.pop(key, None) is None:
            return  # timed out already
        self._answered(backup, batch, answer[0] if isinstance(answer, tuple) else answer)
        self._freed(backup)

    async def _send(self, backup: int, sends: list[tuple[Replicator, Send]]) -> None:
        """Every message for ``backup``, one RPC at a time (more than one only past the limits)."""
        try:
            while sends:
                # past the first RPC, a message may have been given up meanwhile (its copy
                # dropped, its vseg then released): it is not sent, its bytes may be gone
                sends = [(r, s) for r, s in sends if r.log.wanted(s)]
                if not sends:
                    break
                sizes = [s.end - s.offset for _, s in sends]
                _, j = rpc_batches(sizes)[0]
                failed = await self._call(backup, sends[:j], sum(sizes[:j]))
                if failed is not None:
                    self._outcomes(sends[j:], failed)  # not answering: the rest fail alike
                    break
                sends = sends[j:]
        finally:
            self._freed(backup)

    async def _call(self, backup: int, batch: list[tuple[Replicator, Send]],
                    size: int) -> KeraError | None:
        """One replicate RPC; the error if it failed as a whole (connection, timeout)."""
        meta, parts = self._request(batch, size)
        try:
            r, _ = await self.pool.call(self.addr_of(backup), "replicate", meta, parts=parts,
                                        timeout=self.timeout)
        except KeraError as e:
            r = e
        return self._answered(backup, batch, r)

    def _request(self, batch: list[tuple[Replicator, Send]], size: int,
                 made: dict | None = None) -> tuple[dict, list]:
        """A replicate's meta and payload parts, counted as sent. ``made``: the parts of vseg
        ranges sliced for another backup this round, taken as they are (a memoryview per
        chunk, made once, not once per copy: a tenth of a broker's CPU at R=3)."""
        broker, epoch = self.identity()
        meta = {"broker": broker, "epoch": epoch, "entries": [
            [r.log.id, s.vseg.id, s.offset, s.close, s.end - s.offset] for r, s in batch]}
        self.rpcs += 1
        self.entries += len(batch)
        self.bytes += size
        if made is None:
            made = {}
        parts: list = []
        for _, s in batch:
            key = (s.vseg, s.start, s.stop)
            got = made.get(key)
            if got is None:
                got = made[key] = s.parts()
            parts += got
        return meta, parts

    def _answered(self, backup: int, batch: list[tuple[Replicator, Send]],
                  r: dict | KeraError) -> KeraError | None:
        """A replicate's answer (its meta) or failure to each entry's vlog; the error if it
        failed as a whole."""
        if not isinstance(r, KeraError):
            answers = r.get("results")
            if isinstance(answers, list) and len(answers) == len(batch):
                self._outcomes(batch, answers)
                return None
            r = ProtocolError(f"replicate answered {len(batch)} entries with {answers!r:.80}")
        log.warning("replicate to backup %d (%d vseg copies) failed: %s", backup, len(batch), r)
        self._outcomes(batch, r)
        return r

    def _outcomes(self, batch: list[tuple[Replicator, Send]], answers: list | KeraError) -> None:
        """Each entry's answer (a length, or a typed error) to its vlog; a single error: every
        entry failed with it."""
        now = trio.current_time()
        moved = set()
        for k, (r, s) in enumerate(batch):
            a = answers[k] if isinstance(answers, list) else answers
            if isinstance(a, dict) and "length" not in a:
                log.warning("vlog %d vseg %d: backup %d refused: %s", r.log.id, s.vseg.id, s.backup,
                            a.get("message", a.get("code")))
            if r.outcome(s, a, now):
                moved.add(r)
        for r in moved:
            r.moved()


class Replicator:
    """A broker's virtual log, with the events its producers wait on and its trims."""

    def __init__(self, vlog: VirtualLog, hub: ReplicationHub, on_durable: Callable[[], None],
                 live_backups: Callable[[], list] = list):
        self.log = vlog
        self.hub = hub
        self.live_backups = live_backups  # [(backup id, addr)]: where released vsegs are trimmed
        self.trimmed = 0      # floor every live backup was told of
        self.trimming = False
        self.reclaimed = 0    # file bytes backups reported deleted for this vlog
        self.poked = True     # polled in the hub's next round even if idle
        self.on_durable = on_durable  # the broker's pulls look again
        self.durable_changed = trio.Event()
        self.waiters: list = []       # heap of (index, n, fn): called once durable reaches index
        self._waiters = 0
        hub.add(self)

    @property
    def id(self) -> int:
        return self.log.id

    def append(self, segment, offset: int, length: int, body_checksum: int) -> int:
        idx = self.log.append(segment, offset, length, body_checksum)
        vs = self.log.open
        segment.noted(self, vs, vs.size - length)  # where a backup will hold it
        self.hub.appended = True
        self.hub.wake.set()
        return idx

    async def trim(self) -> None:
        """Tell every live backup that this vlog's vsegs below the floor hold nothing live:
        each records the floor (so a recovery knows they were released, not lost) and
        deletes its files of them. Retried after a failure."""
        floor = self.log.floor
        broker, _ = self.hub.identity()
        ok = [True]

        async def one(addr):
            try:
                r, _ = await self.hub.pool.call(
                    addr, "trim", {"broker": broker, "vlog": self.log.id, "floor": floor},
                    timeout=self.log.timeout)
                self.reclaimed += int(r.get("bytes", 0))
            except KeraError as e:
                ok[0] = False
                log.info("vlog %d: trim to vseg %d on %s failed: %s", self.log.id, floor, addr, e)

        try:
            async with trio.open_nursery() as n:
                for _, addr in self.live_backups():
                    n.start_soon(one, addr)
            if ok[0]:
                self.trimmed = max(self.trimmed, floor)
            else:
                await trio.sleep(1.0)
        finally:
            self.trimming = False
            self.hub.wake.set()

    async def wait_durable(self, index: int) -> None:
        while self.log.durable < index:
            await self.durable_changed.wait()

    def poke(self) -> None:
        """Membership changed, or a vseg was closed or released: look again."""
        self.poked = True
        self.hub.wake.set()

    def when_durable(self, index: int, fn: Callable[[KeraError | None], None]) -> None:
        """Call ``fn(None)`` once the durable head reaches ``index`` (at once if it has), or
        ``fn(error)`` if the incarnation ends first: no task waits for it."""
        if self.log.durable >= index:
            fn(None)
            return
        self._waiters += 1
        heapq.heappush(self.waiters, (index, self._waiters, fn))

    def fail_waiters(self, error: KeraError) -> None:
        """The incarnation ended: whoever waits for durability is told ``error``."""
        w, self.waiters = self.waiters, []
        for _, _, fn in w:
            fn(error)

    def moved(self) -> None:
        w, durable = self.waiters, self.log.durable
        while w and w[0][0] <= durable:
            heapq.heappop(w)[2](None)
        self.durable_changed.set()
        self.durable_changed = trio.Event()
        self.on_durable()

    def outcome(self, s: Send, answer, now: float) -> bool:
        """A message's answer: the copy's length or a typed error (as sent, or raised by the
        RPC as a whole). True if the durable head moved."""
        v = self.log
        if type(answer) is int:
            return v.on_reply(s.token, answer, now)
        if isinstance(answer, dict):
            answer = from_wire(answer)
        elif not isinstance(answer, KeraError):
            answer = ProtocolError(f"replicate answer {answer!r:.80}")
        if isinstance(answer, Fenced):
            return v.on_error(s.token, now, fenced=True)
        length = getattr(answer, "length", None)
        return v.on_error(s.token, now, length=length if type(length) is int else None)
