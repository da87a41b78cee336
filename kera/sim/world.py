"""One seeded simulation of a broker's replication and of its recovery.

The real decision code runs unchanged: ``kera.vlog.VirtualLog`` (with
``BackupSet`` placement) replicates, the broker's ``MemoryBudget`` evicts
(``kera.sim.placement``), ``kera.recovery.plan.RecoveryPlan`` plans the
replay and ``kera.recovery.repoint_plan.plan_repoint`` what is re-pointed instead
(``kera.sim.repointing``). What is simulated is everything they do not decide:
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
from collections import Counter

import numpy as np

from ..limits import REPLICATE_INFLIGHT
from ..recovery import repoint_plan as cols
from ..recovery.plan import Done, RecoveryPlan, Step
from ..vlog import BackupSet, VirtualLog, vlog_id
from . import repointing
from .backups import BROKER, EPOCH, SimBackup
from .faults import DEAD_AFTER, Faults
from .placement import STREAM as STREAM_ID
from .placement import SimChunk, SimPlacement
from .rebuild import SimRebuild

RECLAIM_INTERVAL = 0.25  # the broker's reclaim pass (``kera.broker.reclaim``)
RPC_TIMEOUT = 1.0  # the vlog's replicate timeout (and each message's)


class Violation(AssertionError):
    """An invariant broke: the message names the seed and the step."""


class World:
    def __init__(self, seed: int, steps_limit: int = 200_000, window: int | None = None):
        """``window``: replicate messages a vseg copy may have in flight; by default one or the
        broker's ``REPLICATE_INFLIGHT``, drawn apart from the seed's other choices (a seed
        found with one in flight replays with ``window=1``)."""
        self.seed = seed
        self.rng = random.Random(seed)
        r = self.rng
        self.window = window or random.Random(seed ^ 0x77AD).choice((1, REPLICATE_INFLIGHT))
        self.now = 0.0
        self.heap: list = []
        self._seq = 0
        self.steps = 0
        self.steps_limit = steps_limit
        self.replication = r.choice((1, 2, 3, 3, 3))
        self.nbackups = r.choice((1, 2, 3, 4, 5)) if self.replication == 1 else r.choice((3, 4, 5))
        self.backups = {i: SimBackup(i, f"n{i}") for i in range(1, self.nbackups + 1)}
        if r.random() < 0.3:  # the broker's node has a backup too
            self.backups[1].node = "n0"
        self.set = BackupSet("n0", random.Random(seed ^ 0x5EED))
        self._membership()
        self.vlogs = [VirtualLog(vlog_id(EPOCH, i), self.replication, r.choice((1000, 4000, 20000)),
                                 self.set, RPC_TIMEOUT, batch=r.choice((100, 400, 2000)),
                                 window=self.window)
                      for i in range(r.choice((1, 2, 3)))]
        self.placement = SimPlacement(r, self.vlogs, self.replication)
        self.rebuild = SimRebuild(self, RPC_TIMEOUT, DEAD_AFTER)   # frozen vsegs' lost copies
        self.chunks: list[SimChunk] = self.placement.chunks
        self.by_vlog: dict[int, list[SimChunk]] = self.placement.by_vlog
        self.stats: Counter = Counter()
        self.acked = 0
        # network and fault rates for this seed
        self.delay = r.choice((0.001, 0.01, 0.05))
        self.drop = r.choice((0.0, 0.01, 0.05))
        self.dup = r.choice((0.0, 0.02, 0.1))
        self.faults = Faults(self, r.choice((0.0, 0.3, 1.0, 2.0)))   # a simulated second
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

    def membership_changed(self) -> None:
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
        copies = 2 if self.faults.on and self.rng.random() < self.dup else 1
        for _ in range(copies):
            if self.faults.on and self.rng.random() < self.drop:
                continue
            self.at(self.now + self.rng.expovariate(1 / self.delay), self._deliver, v, s, b, b.incarnation,
                    chunks)

    def _deliver(self, v, s, b: SimBackup, incarnation: int, chunks) -> None:
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

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        ingest = self.rng.choice((2.0, 5.0, 10.0))
        self.at(0.0, self._produce, ingest)
        self.at(RECLAIM_INTERVAL, self._reclaim)
        if self.faults.rate:
            self.at(self.rng.uniform(0, 1), self.faults.run, ingest)
        if self.rng.random() < 0.4:
            # the broker dies in the middle of ingest and faults: copies are partial, some
            # chunks were never acknowledged; the backups heal and its vlogs are replayed
            self.run_until(self.rng.uniform(0.2, ingest))
            self.broker_dead = True
            self.faults.heal()
            self.run_until(self.now + 5.0)  # messages already sent still land
            self._recover()
            return self._result()
        self.run_until(ingest)
        self.faults.heal()
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
        if not self.faults.rotten and self.rebuild.rng.random() < 0.5:
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
        backups, and check what the new owners end with (``repointing.check``)."""
        ids = {v.id for v in self.vlogs}
        listings = {b.id: b.listing(ids) for b in self.backups.values() if b.up}
        plan = RecoveryPlan(BROKER, EPOCH, listings, need=self.vlogs[0].need)
        h = self._headers = np.zeros((len(self.chunks), cols.COLUMNS), np.uint64)
        h[:, [cols.VLOG, cols.VSEG, cols.VOFF, cols.SIZE, cols.STREAMLET, cols.GROUP, cols.SEGMENT, cols.OFFSET,
              cols.PRODUCER, cols.SEQUENCE, cols.FLAGS]] = [
            (c.vlog, c.vseg, c.voff, c.size, c.streamlet, c.group, c.segment, c.offset, c.producer,
             c.sequence, c.flags) for c in self.chunks] or np.zeros((0, 11))
        h[:, cols.STREAM] = STREAM_ID
        plain = h[:, cols.FLAGS] == 0   # Kafka offsets, dense per streamlet in append order
        h[plain, cols.RECORDS] = 1
        for s in np.unique(h[plain, cols.STREAMLET]):
            mine = plain & (h[:, cols.STREAMLET] == s)
            h[mine, cols.KAFKA] = np.arange(1, int(mine.sum()) + 1, dtype=np.uint64)
        h[:, cols.LAST] = h[:, cols.SEGMENT]
        h[:, cols.COUNT] = 1
        replayed = frozenset()
        if self.rng.random() < 0.2:  # a streamlet the coordinator replays whole
            replayed = frozenset({(STREAM_ID, self.rng.choice(self.placement.streamlets).index)})
        rp, whole = repointing.repoint(plan, self.backups, self._rows_of, replayed, self.stats, self.fail)
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
        repointing.check(self, rp, whole, got)
        self.stats["evictions"] += self.placement.memory.evictions
        self.stats["refused"] += self.placement.refused
