"""One seeded simulation of a broker's replication and of its recovery.

The real decision code runs unchanged: ``kera.vlog.VirtualLog`` (with
``BackupSet`` placement) replicates, the broker's ``MemoryBudget`` evicts
(``kera.sim.placement``), ``kera.recovery.plan.RecoveryPlan`` plans the
replay and ``kera.recovery.repoint_plan.plan_repoint`` what is re-pointed instead
(``kera.sim.adoption``). What is simulated is everything they do not decide:
the clock (an event heap), the network (delays, drops, duplicates,
reordering, timeouts), the broker's placement of chunks in streamlets,
groups and segments, backups (copies kept as chunk ids; pauses, crashes,
restarts, full disks, bit flips and torn tails of their files), the failure
detector, and the I/O of the broker's rebuilding of frozen vsegs' lost copies
(``kera.sim.rebuild``, its decisions the broker's own ``Rebuilder``).

A run has three phases: ingest under faults, heal (faults stop; every
appended chunk must become durable: progress; and the memory budget must
take a new segment again, its filled segments settling and evicted; in half the runs
without rot, backups are then lost for good one after the other, each once every
vseg is whole again, the first too: a backup destroyed late in the faults is repaired
first), then the broker dies, its
settled history is re-pointed and the rest of its vlogs replayed from the
backups (every acknowledged chunk must come back exactly once, adopted or
replayed, in order). Invariants are checked after every step; the first one
broken raises ``Violation`` naming the seed, which replays exactly.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..backup.store import NEW, BackupStore
from ..errors import KeraError
from ..recovery import repoint_plan as cols
from ..recovery.plan import CORRUPT, END, Done, RecoveryPlan, Step
from ..vlog import BackupSet, VirtualLog, vlog_id
from . import adoption
from .placement import STREAM as STREAM_ID
from .placement import Chunk, Placement
from .rebuild import SimRebuild

BROKER, EPOCH = 1, 1
DEAD_AFTER = 2.0   # the failure detector's delay
RECLAIM_INTERVAL = 0.25  # the broker's reclaim pass (``kera.broker.reclaim``)
RPC_TIMEOUT = 1.0  # the vlog's replicate timeout (and each message's)


class Violation(AssertionError):
    """An invariant broke: the message names the seed and the step."""


@dataclass
class Replica:
    """A copy as the simulator keeps it: chunk ids, not bytes. ``length``, ``closed``,
    ``damaged`` and ``error`` are what ``BackupStore``'s rules read of a replica."""

    chunks: list = field(default_factory=list)   # (cid, size), in order
    ends: list = field(default_factory=list)     # byte end of each
    closed: bool = False
    bad: set = field(default_factory=set)        # indexes of corrupt chunks
    known_bad: set = field(default_factory=set)  # ... of which the backup's index knows
    headers: set = field(default_factory=set)    # ... of which the flip hit the header
    reloaded: bool = False   # read back from its file (a restart): index checks the headers again
    damaged: bool = False
    error: str | None = None

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0


class Backup:
    """A backup process; what it accepts is decided by the real ``BackupStore`` rules."""

    def __init__(self, id: int, node: str):
        self.id, self.node = id, node
        self.incarnation = 1
        self.up = True          # process running (possibly paused)
        self.paused_until = 0.0
        self.declared_dead = False
        self.destroyed = False  # its disk is gone: never comes back
        self.store = BackupStore()
        self.replicas: dict[tuple[int, int, int], Replica] = self.store.replicas
        self.held: set[int] = set()  # chunk ids it ever wrote (damage later is the fault budget's)

    @property
    def full(self) -> bool:
        return self.store.max_bytes == 1

    @full.setter
    def full(self, full: bool) -> None:
        self.store.max_bytes = 1 if full else 0  # a full disk: no byte more, not even a trailer

    def replicate(self, vlog: int, vseg: int, offset: int, chunks: list, close: bool):
        """('ok', length), ('length', length) or ('error', why), as the backup service answers."""
        key = (BROKER, vlog, vseg)
        try:
            d = self.store.accept_replicate(key, EPOCH, offset, sum(size for _, size in chunks), close)
            if d.stores:
                self.store.check_limits(d)
        except KeraError as e:
            length = getattr(e, "length", None)
            return ("length", length) if isinstance(length, int) else ("error", str(e))
        if d.kind == NEW:
            self.replicas[key] = Replica()
        rep = self.replicas.get(key)
        if d.take:
            for cid, size in chunks:
                rep.chunks.append((cid, size))
                rep.ends.append(rep.length + size)
                self.held.add(cid)
        if d.close and d.stores:
            rep.closed = True
        return "ok", d.length

    def listing(self, vlog_ids) -> list[dict]:
        out = []
        for (_, vlog, vseg), rep in self.replicas.items():
            if vlog not in vlog_ids:
                continue
            corrupt = [{"offset": rep.ends[i] - rep.chunks[i][1], "length": rep.chunks[i][1],
                        "reason": "checksum"} for i in sorted(rep.known_bad)]
            out.append({"broker": BROKER, "vlog": vlog, "vseg": vseg, "length": rep.length,
                        "chunks": len(rep.chunks), "closed": rep.closed, "corrupt": corrupt,
                        "checksum": None})
        return out

    def index(self, vlog: int, vseg: int, rows_of) -> np.ndarray | None:
        """The index rows of a closed, intact copy; None when the backup refuses it, as the real
        ``index`` does: missing, not closed, known corrupt, or a header found rotten (then
        marked corrupt) when the copy was reloaded from its file; rows kept since the close
        are not checked again, so rot in a copy never reloaded is found only when read."""
        rep = self.replicas.get((BROKER, vlog, vseg))
        if rep is None or not rep.closed or rep.known_bad:
            return None
        if rep.reloaded and rep.headers:
            rep.known_bad |= rep.headers
            return None
        return rows_of(vlog, vseg, [cid for cid, _ in rep.chunks], rep.ends)

    def intact(self, c: Chunk) -> bool:
        """Whether this backup holds chunk ``c`` (at its vseg offset) uncorrupted."""
        rep = self.replicas.get((BROKER, c.vlog, c.vseg))
        if rep is None:
            return False
        i = bisect_right(rep.ends, c.voff)
        return i < len(rep.chunks) and rep.chunks[i][0] == c.cid and i not in rep.bad

    def reload(self) -> None:
        """The process restarted: its copies are read back from their files."""
        for rep in self.replicas.values():
            rep.reloaded = True

    def replay(self, vlog: int, vseg: int, offset: int):
        """Chunks from ``offset`` until the copy's end or its first corrupt chunk."""
        rep = self.replicas[(BROKER, vlog, vseg)]
        out, pos = [], offset
        for i, (cid, size) in enumerate(rep.chunks):
            start = rep.ends[i] - size
            if start < offset:
                continue
            if i in rep.bad:
                return out, start, CORRUPT, start + size
            out.append(cid)
            pos = rep.ends[i]
        return out, pos, END, None


class World:
    def __init__(self, seed: int, steps_limit: int = 200_000):
        self.seed = seed
        self.rng = random.Random(seed)
        r = self.rng
        self.now = 0.0
        self.heap: list = []
        self._seq = 0
        self.steps = 0
        self.steps_limit = steps_limit
        self.replication = r.choice((1, 2, 3, 3, 3))
        self.nbackups = r.choice((1, 2, 3, 4, 5)) if self.replication == 1 else r.choice((3, 4, 5))
        self.backups = {i: Backup(i, f"n{i}") for i in range(1, self.nbackups + 1)}
        if r.random() < 0.3:  # the broker's node has a backup too
            self.backups[1].node = "n0"
        self.set = BackupSet("n0", random.Random(seed ^ 0x5EED))
        self._membership()
        self.vlogs = [VirtualLog(vlog_id(EPOCH, i), self.replication, r.choice((1000, 4000, 20000)),
                                 self.set, RPC_TIMEOUT, batch=r.choice((100, 400, 2000)))
                      for i in range(r.choice((1, 2, 3)))]
        self.placement = Placement(r, self.vlogs, self.replication)
        self.rebuild = SimRebuild(self, RPC_TIMEOUT, DEAD_AFTER)   # frozen vsegs' lost copies
        self.chunks: list[Chunk] = self.placement.chunks
        self.by_vlog: dict[int, list[Chunk]] = self.placement.by_vlog
        self.stats: Counter = Counter()
        self.acked = 0
        # network and fault rates for this seed
        self.delay = r.choice((0.001, 0.01, 0.05))
        self.drop = r.choice((0.0, 0.01, 0.05))
        self.dup = r.choice((0.0, 0.02, 0.1))
        self.fault_rate = r.choice((0.0, 0.3, 1.0, 2.0))   # faults per simulated second
        self.damage_budget = max(0, self.replication - 2)  # backup copies that may rot or vanish
        self.damaged: set[int] = set()
        self.rotten = False   # a bit flipped in a file (rot a backup may not know of)
        self.faults_on = True
        self.log: list[str] = []
        self._acked_upto: dict[int, int] = {}  # per vlog: chunks already checked and acknowledged
        self._timer: dict[int, float] = {}      # per vlog: when its poll timer fires
        self.broker_dead = False                # from then on its vlogs neither send nor hear

    # -- the event loop --------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, fn, args))

    def run_until(self, t_end: float, done=lambda: False) -> None:
        while self.heap and not done():
            t, _, fn, args = self.heap[0]
            if t > t_end:
                break
            heapq.heappop(self.heap)
            self.now = t
            fn(*args)
            self.steps += 1
            if self.steps > self.steps_limit:
                self.fail("step limit reached (a livelock?)")
        self.now = max(self.now, t_end) if not done() else self.now

    def fail(self, what: str) -> None:
        raise Violation(f"seed {self.seed}: t={self.now:.3f} {what}\n  recent: " + "\n  ".join(self.log[-12:]))

    def note(self, what: str) -> None:
        self.log.append(f"t={self.now:.3f} {what}")
        if len(self.log) > 200:
            del self.log[:100]

    # -- membership ----------------------------------------------------------------------
    def _membership(self) -> None:
        self.set.set_live({b.id: (b.node, b.incarnation) for b in self.backups.values()
                           if b.up and not b.declared_dead})

    def _membership_changed(self) -> None:
        self._membership()
        self.kick()
        self.rebuild.run()

    # -- the broker's replicators -------------------------------------------------------------
    def kick(self) -> None:
        for v in self.vlogs:
            self._poll(v)

    def _poll(self, v: VirtualLog) -> None:
        if self.broker_dead:
            return
        for s in v.poll(self.now):
            self._send(v, s)
        d = v.next_deadline(self.now)
        if d is not None and d < self._timer.get(v.id, float("inf")):
            self._timer[v.id] = d
            self.at(max(d, self.now), self._on_timer, v, d)

    def _on_timer(self, v: VirtualLog, d: float) -> None:
        if self._timer.get(v.id) == d:
            del self._timer[v.id]
            self._poll(v)

    def _send(self, v: VirtualLog, s) -> None:
        b = self.backups[s.backup]
        chunks = [(seg.cid_at(off), n) for seg, off, n in s.vseg.refs[s.start:s.stop]]
        if any(cid is None for cid, _ in chunks):
            self.fail(f"vlog {v.id} vseg {s.vseg.id}: a replicate needs the bytes of an evicted segment")
        deadline = self.now + RPC_TIMEOUT
        self.at(deadline, self._timeout, v, s.token)
        copies = 2 if self.faults_on and self.rng.random() < self.dup else 1
        for _ in range(copies):
            if self.faults_on and self.rng.random() < self.drop:
                continue
            self.at(self.now + self.rng.expovariate(1 / self.delay), self._deliver, v, s, b, b.incarnation,
                    chunks)

    def _deliver(self, v, s, b: Backup, incarnation: int, chunks) -> None:
        if not b.up or b.incarnation != incarnation:
            return  # the process that was sent to is gone
        if b.paused_until > self.now:
            self.at(b.paused_until, self._deliver, v, s, b, incarnation, chunks)
            return
        res = b.replicate(v.id, s.vseg.id, s.offset, chunks, s.close)
        self.at(self.now + self.rng.expovariate(1 / self.delay), self._reply, v, s.token, res)

    def _reply(self, v: VirtualLog, token: int, res) -> None:
        if self.broker_dead:
            return
        kind, val = res
        if kind == "ok":
            moved = v.on_reply(token, val, self.now)
        elif kind == "length":
            moved = v.on_error(token, self.now, length=val)
        else:
            moved = v.on_error(token, self.now)
        if moved:
            self._check_durable(v)
        self._poll(v)

    def _timeout(self, v: VirtualLog, token: int) -> None:
        if token in v.sent and not self.broker_dead:
            v.on_error(token, self.now)
            self._poll(v)

    # -- producers ------------------------------------------------------------------------------
    def _produce(self, until: float) -> None:
        if self.now >= until or self.broker_dead:
            return
        p = self.placement
        sl = self.rng.choice(p.streamlets)
        producer = self.rng.randrange(p.producers)
        touched = {p.append(sl, producer, self.rng.randint(10, 200)) for _ in range(self.rng.randint(1, 4))}
        for v in self.vlogs:
            if v in touched:
                self._poll(v)
        self.at(self.now + self.rng.expovariate(50), self._produce, until)

    def _reclaim(self) -> None:
        """The broker's reclaim pass, as often: the budget evicts, and closes the open vsegs
        the oldest filled segments wait in while memory stays above its low-water mark."""
        if self.broker_dead:
            return
        p = self.placement
        if p.memory.used != p.charged():
            self.fail(f"the memory budget counts {p.memory.used} bytes, its segments' buffers "
                      f"take {p.charged()}")
        closed = p.memory.relieve()
        self.stats["budget_closes"] += len(closed)
        for r in closed:
            self._poll(r.log)
        self.at(self.now + RECLAIM_INTERVAL, self._reclaim)

    def _check_durable(self, v: VirtualLog) -> None:
        """Acks: every chunk below the durable head is on ``need`` backups, intact, right now."""
        chunks = self.by_vlog[v.id]
        for c in chunks[self._acked_upto.get(v.id, 0):v.durable]:
            holders = sum(1 for b in self.backups.values() if c.cid in b.held)
            if holders < v.need:
                self.fail(f"chunk {c.cid} of vlog {v.id} acknowledged with {holders} of {v.need} copies")
            if not c.is_durable():
                self.fail(f"chunk {c.cid} counted durable but its segment head did not move")
            c.acked_at = self.now
        self._acked_upto[v.id] = v.durable

    # -- faults -------------------------------------------------------------------------------------
    def _fault(self, until: float) -> None:
        if self.now >= until or not self.faults_on:
            return
        r = self.rng
        live = [b for b in self.backups.values() if b.up and not b.destroyed]
        kind = r.choice(("pause", "pause", "crash", "full", "flip", "torn", "destroy"))
        if live:
            b = r.choice(live)
            if kind == "pause" and b.paused_until <= self.now:
                d = r.choice((0.3, 1.5, 3.0, 8.0))
                b.paused_until = self.now + d
                self.note(f"pause backup {b.id} for {d}")
                if d > DEAD_AFTER:
                    self.at(self.now + DEAD_AFTER, self._declare_dead, b, b.incarnation)
                self.at(b.paused_until, self._resume, b, b.incarnation)
            elif kind == "crash":
                self.note(f"crash backup {b.id}")
                b.up = False
                self.at(self.now + DEAD_AFTER, self._declare_dead, b, b.incarnation)
                self.at(self.now + r.uniform(0.5, 6.0), self._restart, b)
            elif kind == "full":
                b.full = True
                self.note(f"disk full on backup {b.id}")
                self.at(self.now + r.uniform(0.5, 5.0), setattr, b, "full", False)
            elif kind in ("flip", "torn", "destroy") and self._may_damage(b):
                self._damage(b, kind)
        self.at(self.now + r.expovariate(self.fault_rate), self._fault, until)

    def _may_damage(self, b: Backup) -> bool:
        if b.id in self.damaged:
            return True
        if len(self.damaged) < self.damage_budget:
            self.damaged.add(b.id)
            return True
        return False

    def _damage(self, b: Backup, kind: str) -> None:
        reps = [rep for rep in b.replicas.values() if rep.chunks]
        if kind == "destroy":
            self.note(f"backup {b.id} destroyed with its disk")
            b.up, b.destroyed = False, True
            b.replicas.clear()
            self.at(self.now + DEAD_AFTER, self._declare_dead, b, b.incarnation)
            return
        if not reps:
            return
        rep = self.rng.choice(reps)
        if kind == "flip":  # a bit flipped: found on load or when read
            self.rotten = True
            i = self.rng.randrange(len(rep.chunks))
            rep.bad.add(i)
            if self.rng.random() < 0.5:
                rep.known_bad.add(i)
            if self.rng.random() < 0.5:
                rep.headers.add(i)
            self.note(f"bit flip on backup {b.id} chunk {rep.chunks[i][0]}")
        else:  # a torn tail: the backup process restarts with its file cut
            cut = self.rng.randrange(len(rep.chunks))
            self.note(f"torn tail on backup {b.id}: {len(rep.chunks) - cut} chunks cut")
            del rep.chunks[cut:]
            del rep.ends[cut:]
            rep.closed = False
            rep.bad = {i for i in rep.bad if i < cut}
            rep.known_bad = {i for i in rep.known_bad if i < cut}
            rep.headers = {i for i in rep.headers if i < cut}
            b.reload()
            b.incarnation += 1  # it restarted: a new incarnation, as after a crash, which
            b.declared_dead, b.paused_until = False, 0.0   # registers even if paused or dead before
            self._membership_changed()

    def _declare_dead(self, b: Backup, incarnation: int) -> None:
        if b.incarnation == incarnation and (not b.up or b.paused_until > self.now):
            b.declared_dead = True
            self.note(f"backup {b.id} declared dead")
            self._membership_changed()

    def _resume(self, b: Backup, incarnation: int) -> None:
        if b.incarnation == incarnation and b.up and b.declared_dead:
            b.incarnation += 1  # fenced out while paused: it registers again
            b.declared_dead = False
            self.note(f"backup {b.id} back as incarnation {b.incarnation}")
            self._membership_changed()

    def _restart(self, b: Backup) -> None:
        if b.destroyed or b.up:
            return
        b.up, b.declared_dead, b.paused_until = True, False, 0.0
        b.reload()
        b.incarnation += 1
        self.note(f"backup {b.id} restarted as incarnation {b.incarnation}")
        self._membership_changed()

    def _heal(self) -> None:
        self.faults_on = False
        for b in self.backups.values():
            b.full = False
            if b.paused_until > self.now:
                b.paused_until = self.now
                self._resume(b, b.incarnation)
            if not b.up and not b.destroyed:
                self._restart(b)
        self.kick()

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        ingest = self.rng.choice((2.0, 5.0, 10.0))
        self.at(0.0, self._produce, ingest)
        self.at(RECLAIM_INTERVAL, self._reclaim)
        if self.fault_rate:
            self.at(self.rng.uniform(0, 1), self._fault, ingest)
        if self.rng.random() < 0.4:
            # the broker dies in the middle of ingest and faults: copies are partial, some
            # chunks were never acknowledged; the backups heal and its vlogs are replayed
            self.run_until(self.rng.uniform(0.2, ingest))
            self.broker_dead = True
            self._heal()
            self.run_until(self.now + 5.0)  # messages already sent still land
            self._recover()
            return self._result()
        self.run_until(ingest)
        self._heal()
        # progress: once faults stop, everything appended becomes durable
        limit = self.now + 60.0
        self.run_until(limit, lambda: all(v.durable == v.appended for v in self.vlogs))
        stuck = [(v.id, v.durable, v.appended) for v in self.vlogs if v.durable != v.appended]
        if stuck:
            self.fail(f"no progress after faults healed: vlogs (id, durable, appended) {stuck}")
        # and the memory budget takes a new segment again: what it holds settles and is evicted
        p = self.placement
        self.run_until(self.now + 30.0, p.takes_segment)
        if not p.takes_segment():
            self.fail(f"every chunk durable, yet the memory budget refuses a new segment: "
                      f"{p.memory.used} of {p.memory.limit} bytes used")
        if not self.rotten and self.rebuild.rng.random() < 0.5:
            self.rebuild.lose()   # backups lost for good, one after the other
        self._recover()
        return self._result()

    def _result(self) -> dict:
        """What the run did: its size and what recovery re-pointed (``stats``)."""
        return {"seed": self.seed, "chunks": len(self.chunks), "steps": self.steps, "t": self.now,
                **self.stats}

    def _rows_of(self, vlog: int, vseg: int, cids: list[int], ends: list[int]) -> np.ndarray:
        """What a backup's ``index`` gives (as the coordinator's rows) for a copy holding
        ``cids``: the chunks' headers and where the copy holds each."""
        rows = self._headers[cids]
        rows[:, cols.VSEG] = vseg
        rows[:, cols.VOFF] = np.asarray(ends, np.uint64) - rows[:, cols.SIZE]
        if (rows[:, cols.VLOG] != vlog).any():
            self.fail(f"backup copy of vlog {vlog} vseg {vseg} holds chunks of another vlog")
        return rows

    def _recover(self) -> None:
        """The broker dies: re-point its settled history, replay the rest of its vlogs from the
        backups, and check what the new owners end with (``adoption.check``)."""
        ids = {v.id for v in self.vlogs}
        listings = {b.id: b.listing(ids) for b in self.backups.values() if b.up}
        plan = RecoveryPlan(BROKER, EPOCH, listings)
        h = self._headers = np.zeros((len(self.chunks), cols.COLUMNS), np.uint64)
        h[:, [cols.VLOG, cols.VSEG, cols.VOFF, cols.SIZE, cols.STREAMLET, cols.GROUP, cols.SEGMENT, cols.OFFSET,
              cols.PRODUCER, cols.SEQUENCE, cols.FLAGS]] = [
            (c.vlog, c.vseg, c.voff, c.size, c.streamlet, c.group, c.segment, c.offset, c.producer,
             c.sequence, c.flags) for c in self.chunks] or np.zeros((0, 11))
        h[:, cols.STREAM] = STREAM_ID
        h[:, cols.LAST] = h[:, cols.SEGMENT]
        h[:, cols.COUNT] = 1
        replayed = frozenset()
        if self.rng.random() < 0.2:  # a streamlet the coordinator replays whole
            replayed = frozenset({(STREAM_ID, self.rng.choice(self.placement.streamlets).index)})
        rp, whole = adoption.repoint(plan, self.backups, self._rows_of, replayed, self.stats, self.fail)
        below = rp.replay_from
        got: dict[int, list[int]] = {}
        for vlog in plan.vlogs:
            out = got.setdefault(vlog, [])
            while isinstance(step := plan.next_step(vlog), Step):
                cids, stopped, reason, resume = self.backups[step.backup].replay(vlog, step.vseg, step.offset)
                if below:  # the backup leaves out chunks of re-pointed segments
                    cids = [cid for cid in cids if (c := self.chunks[cid]).segment >= below.get(
                        (STREAM_ID, c.streamlet, c.group), 0)]
                out += cids
                plan.step_done(vlog, step.vseg, step.backup, stopped, reason, resume)
            if not isinstance(step, Done):
                self.note(f"recovery of vlog {vlog} truncated ({step.reason})")
        adoption.check(self, rp, whole, got)
        self.stats["evictions"] += self.placement.memory.evictions
        self.stats["refused"] += self.placement.refused
