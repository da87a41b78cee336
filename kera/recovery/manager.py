"""RecoveryManager: bring a dead broker's streamlets back from the backups.

A streamlet is orphaned when the incarnation (broker id, epoch) that owns it
is no longer alive: it died, or came back as a new incarnation, or the whole
cluster restarted. For each orphaned incarnation the coordinator:

1. fences it on every live backup (replicas from that epoch are refused, so a
   stale process can never make a write durable again);
2. picks new owners, spread over the live brokers, and assigns them the
   streamlets in *recovering* state (no produce, no pull yet);
3. asks the backups what they hold of that incarnation's virtual logs and
   follows a ``kera.recovery.plan.RecoveryPlan``: each vlog's virtual
   segments in order (vlogs in parallel, so many backups work at once), each
   step replaying one copy from an offset until it ends or reaches a corrupt
   chunk, the next step continuing from another copy at that offset; a
   backup pushes each chunk to its streamlet's new owner, which places it at
   the [group, segment, offset] its header records and replicates it through
   its own virtual logs;
4. when every vlog is replayed and durable again, hands the streamlets over
   (owners updated and persisted), and — only if every vlog was replayed to
   its end — records the incarnation as recovered (``kera.coordinator.recovered``): every
   backup, the ones down now included when they are back, drops its old
   replicas and releases the dead incarnation's own claims (its successors
   claimed again what they adopted from it). Files that new owners claimed
   (adopted segments read from them, ``kera.recovery.repoint``) stay until released.

Nothing is called complete without proof. Before it starts, a recovery
waits (state ``waiting``) until fewer than ``need`` of the backups that may
hold the incarnation's copies are down, ``need`` being the number of backup
copies of its least replicated vlog: every acknowledged chunk is then on at
least one backup that answers the listing, so no vseg and no vlog holding one
can be missing from it, and a log that ends there really ends there. The
backups that may hold copies are those the incarnation was told are alive
(``Member.told``), or every backup ever known when this coordinator cannot
know that (it started, or took over, after the incarnation registered). A
mass failure, or a coordinator cut off from everyone, thus recovers nothing
until the backups are heard from again. Past the grace period (counted from
the first attempt) a recovery goes on without that proof: its groups are
sealed, it is reported as ``unproven`` and no copy of that incarnation is
dropped.

A log that ends early (no copy holds a chunk intact, a vseg is missing) is
accepted only once every known backup is up, or the grace period is over: a
backup that is down may hold the missing bytes. It is then reported loudly
and exactly (log, ``describe()["lost"]``, ``kera status``) and no copy of
that incarnation is dropped.

A recovery that fails (a new owner or a backup died) is abandoned and
planned again from the start; replays are idempotent because placement is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from .. import failpoints
from ..errors import KeraError, Unavailable
from ..limits import MAX_BATCH_STREAMS
from .adoption import Adoptions
from .listing import list_backups
from .needs import Liveness, MetaStore, Owners, RecoveredList, Settings
from .plan import (
    CORRUPT,
    END,
    FAILED,
    REFUSED,
    Done,
    RecoveryPlan,
    Step,
    Truncated,
    backup_copies,
)
from .repoint import repoint
from .routes import pack_routes
from .state import Recovery, State

log = logging.getLogger("kera.recovery")

REPLAY_TIMEOUT = 600.0
RETRY_DELAY = 0.5
WAIT_DELAY = 2.0  # between attempts while a log ends early and backups may still bring the rest
PACE = 4096      # streamlets a recovery's bulk steps handle between checkpoints (a few ms each)


class LogIncomplete(Unavailable):
    """A log ends early while a backup that may hold the rest is down or failed: try again later."""


class BackupsAwaited(LogIncomplete):
    """Too many of the backups that may hold the incarnation's copies are down to prove its
    log complete: not started, tried again once one of them is back."""

    def __init__(self, message: str, down: list[int]):
        super().__init__(message)
        self.down = down


class RecoveryManager:
    """The recoveries of one coordinator term. It is handed the term's ``roster``,
    ``metadata`` (fences, owners, commits), ``placement`` (new owners), ``adoptions`` (the
    closed history adopted after a hand-over) and ``recovered`` (what the backups let go),
    the coordinator's ``pool()``, its ``settings``, and ``ended(recovery, ok)``, told as each
    attempt ends that is not a wait (the metrics)."""

    def __init__(self, roster: Liveness, metadata: MetaStore, placement: Owners, adoptions: Adoptions,
                 recovered: RecoveredList, pool: Callable, settings: Settings,
                 ended: Callable[[Recovery, bool], None]):
        self.roster, self.metadata, self.placement = roster, metadata, placement
        self.adoptions, self.recovered, self.pool = adoptions, recovered, pool
        self.settings, self.ended = settings, ended
        self.grace = settings.grace  # after a coordinator start, time for backups to come back
        self.started = time.monotonic()
        self.active: dict[tuple[int, int], Recovery] = {}
        self.history: list[Recovery] = []
        self.losses: list[Recovery] = []  # recoveries that lost data, kept past the short history
        self.not_before: dict[tuple[int, int], float] = {}
        self.first_try: dict[tuple[int, int], float] = {}  # grace for truncations counts from here
        # incarnations waiting for backups that may hold their copies: its last attempt, and
        # the backups it waits for (one of them back: tried again at once)
        self.waiting: dict[tuple[int, int], tuple[Recovery, frozenset[int]]] = {}

    def orphans(self) -> list[tuple[int, int]]:
        """The incarnations no longer alive that own streamlets (an index lookup, not a walk
        over every stream or streamlet: it runs ten times a second)."""
        return self.metadata.holdings.dead(lambda b, e: self.roster.live_broker(b, e) is not None)

    def _backups_ready(self) -> bool:
        """Every backup ever known is back, or was seen dying, or the grace is over.

        After a whole-cluster restart the replicas are spread over all
        backups: recovering from the first few to come back would hand over
        streamlets with chunks missing.
        """
        known = set(self.metadata.state.get("backups", []))
        seen = set(self.roster.members["backup"])  # registered since this coordinator started
        return known <= seen or time.monotonic() - self.started > self.grace

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(0.1)
                if not self._backups_ready() or not self.roster.live("broker"):
                    continue
                now = time.monotonic()
                if now - self.started < self.settings.rejoin_wait:
                    continue  # after a coordinator restart live brokers rejoin as themselves first
                orphans = set(self.orphans())
                up = {m.id for m in self.roster.live("backup")}
                for key in orphans:
                    if key not in self.active and (self.not_before.get(key, 0) <= now or (
                            key in self.waiting and self.waiting[key][1] & up)):
                        self.first_try.setdefault(key, now)
                        sls = self.metadata.holdings.streamlets(key)
                        rec = self.active[key] = Recovery(key[0], key[1], sls)
                        nursery.start_soon(self._run_one, rec)
                self._forget(orphans)

    def _forget(self, orphans: set) -> None:
        """Drop what is kept of incarnations that own nothing any more (recovered, or their
        streams deleted): replaced members, waits."""
        self.roster.forget(lambda k: k in orphans or k in self.active)
        for key in [k for k in self.waiting if k not in orphans]:
            del self.waiting[key]

    async def _run_one(self, rec: Recovery) -> None:
        key = (rec.broker, rec.epoch)
        waited = self.waiting.pop(key, (None, None))[1]
        if waited is None:
            log.warning("recovering broker %d epoch %d: %d streamlets", rec.broker, rec.epoch,
                        len(rec.streamlets))
        try:
            await self._recover(rec)
            rec.state = State.DONE
            self.first_try.pop(key, None)
            self.not_before.pop(key, None)
            if rec.lost or rec.unproven:
                log.error("recovered broker %d epoch %d WITH DATA LOST%s (copies kept): %s",
                          rec.broker, rec.epoch, "" if rec.lost else " POSSIBLY", rec.describe())
            else:
                log.warning("recovered broker %d epoch %d: %s", rec.broker, rec.epoch, rec.describe())
        except Exception as e:  # noqa: BLE001 (a failed attempt is planned again, whatever broke)
            while isinstance(e, ExceptionGroup) and e.exceptions:  # the first cause says it best
                e = e.exceptions[0]
            rec.error = f"{type(e).__name__}: {e}"
            if isinstance(e, BackupsAwaited):
                rec.state = State.WAITING
                self.waiting[key] = (rec, frozenset(e.down))
                if waited != self.waiting[key][1]:
                    log.warning("recovery of broker %d epoch %d waits: %s", rec.broker, rec.epoch, e)
            else:
                rec.state = State.FAILED
                log.warning("recovery of broker %d epoch %d failed, will retry: %s", rec.broker,
                            rec.epoch, e)
            delay = WAIT_DELAY if isinstance(e, LogIncomplete) else RETRY_DELAY
            self.not_before[key] = time.monotonic() + delay
        finally:
            rec.finished = time.time()
            del self.active[key]
            if rec.state != State.WAITING:
                self.ended(rec, rec.state == State.DONE)
            if rec.state != State.WAITING:   # a wait is shown once, as the incarnation's state
                self.history = (self.history + [rec])[-20:]
            if rec.lost or rec.unproven:
                self.losses = (self.losses + [rec])[-100:]
            self.roster.notify()

    async def _streams(self, rec: Recovery) -> dict:
        """The streams of the incarnation's streamlets that still exist, read a slice at a
        time: after a whole-cluster restart an incarnation owned a third of a million, and a
        coordinator that decodes them in one go answers no heartbeat for seconds (every
        broker's lease runs out, and the recovery fails on brokers that stopped serving)."""
        known, out = self.metadata.streams, {}
        for k, (n, _) in enumerate(rec.streamlets):
            if n not in out and n in known:
                out[n] = known[n]
            if k % PACE == PACE - 1:
                await trio.sleep(0)
        return out

    def _prove(self, rec: Recovery, backups: list, need: int) -> None:
        """Raise ``BackupsAwaited`` unless the live ``backups`` hold a copy of every chunk the
        incarnation had acknowledged (see the module doc); past the grace, note on ``rec``
        which backups it goes on without."""
        inc = self.roster.incarnation(rec.broker, rec.epoch)
        could = inc.told if inc is not None and inc.told_all else set(self.metadata.state["backups"])
        down = sorted(could - {b.id for b in backups})
        if len(down) < need:
            return
        first = self.first_try.get((rec.broker, rec.epoch), time.monotonic())
        if time.monotonic() - first < self.grace:
            raise BackupsAwaited(f"backups {down} may hold its copies and are down ({need} or more "
                                 f"down: its log cannot be proven complete)", down)
        rec.unproven = down
        log.error("recovery of broker %d epoch %d goes on WITHOUT PROOF after %.0f s: backups %s "
                  "that may hold its copies are still down; its groups are sealed, no copy is "
                  "dropped", rec.broker, rec.epoch, self.grace, down)

    async def _recover(self, rec: Recovery) -> None:
        md, members = self.metadata, self.roster.members
        backups = self.roster.live("backup")
        streams = await self._streams(rec)
        self._prove(rec, backups, backup_copies(s.replication for s in streams.values()))
        # 1. fence the dead incarnation everywhere it could still write
        with rec.phase("fence"):
            md.fence(rec.broker, rec.epoch)
            await md.commit()
            async with trio.open_nursery() as n:
                for b in backups:  # a backup that does not answer gets the fence when it registers
                    n.start_soon(self._quiet, b.addr, "fence", {"broker": rec.broker, "epoch": rec.epoch})
        # 2. new owners, in recovering state
        plan, entries = await self._plan(rec, streams)

        async def assign_all(recovering: bool, seal: bool = False, held_since=None) -> None:
            """One request per target broker (or as few as a frame allows), all in parallel."""
            async with trio.open_nursery() as n:
                for mid, mine in entries.items():
                    n.start_soon(self.placement.assign, members["broker"][mid], mine, recovering,
                                 seal, held_since)

        assigned = md.streams.alters   # the maps the new owners are given below are as of this
        try:
            with rec.phase("assign"):
                await assign_all(recovering=True)
            rec.state = State.REPLAYING
            replayed = await self._replay(rec, backups, streams, plan)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                async with trio.open_nursery() as n:
                    for mid, mine in entries.items():
                        n.start_soon(self._unassign, members["broker"][mid], mine)
            raise
        # 4. hand over: the new owners serve, the metadata says so
        # after a loss the groups are sealed: no position of the lost range is ever reused
        complete = replayed.complete and not rec.unproven
        await failpoints.hit("recovery.handover", f"{rec.broker} {rec.epoch}")
        with rec.phase("handover"):
            await assign_all(recovering=False, seal=not complete, held_since=assigned)
            # before the owners (etcd stores it first): never owners without it; merged into a
            # record an earlier hand-over of this incarnation left (its commit cut short)
            deferred = rec.deferred or self.adoptions.has(rec.broker, rec.epoch)
            if deferred:
                self.adoptions.record(rec.broker, rec.epoch, rec.deferred, replayed.covered(),
                                       complete, [(streams[n].id, i) for n, i in plan])
            for k, ((name, i), m) in enumerate(plan.items()):
                # (one deleted or re-created meanwhile: kept out)
                md.set_owner(streams[name], i, m, was=(rec.broker, rec.epoch))
                if k % PACE == PACE - 1:
                    await trio.sleep(0)
            if complete and not deferred:  # else what is left may be all there is of
                # the lost range: kept. Every backup, now or when it is back, drops this
                # incarnation's files (a claimed one stays until released) and releases its
                # claims: told once the owners are durable (with a deferred adoption, once done)
                self.recovered.add(rec.broker, rec.epoch, replayed.covered())
            await md.commit()
        rec.served = time.time()
        self.adoptions.poke()

    async def _plan(self, rec: Recovery, streams: dict) -> tuple[dict, dict]:
        """New owners for the streamlets of ``streams`` (those deleted meanwhile left out),
        spread over the live brokers a slice at a time: ``plan`` ((stream, streamlet) ->
        member) and ``entries`` (broker id -> [[stream, streamlets], ...])."""
        known = self.metadata.streams
        for k, n in enumerate(list(streams)):
            if n not in known:
                del streams[n]
            if k % PACE == PACE - 1:
                await trio.sleep(0)
        sls = [(n, i) for n, i in rec.streamlets if n in streams]
        loads = self.placement.loads()
        plan: dict[tuple, object] = {}
        per_target: dict[int, dict[str, list[int]]] = {}   # broker -> stream -> streamlets
        for start in range(0, len(sls), PACE):
            part = sls[start:start + PACE]
            for (name, i), m in zip(part, self.placement.spread(len(part), rec.broker, loads), strict=True):
                plan[(name, i)] = m
                per_target.setdefault(m.id, {}).setdefault(name, []).append(i)
            await trio.sleep(0)
        entries: dict[int, list] = {}
        for mid, mine in per_target.items():
            out = entries[mid] = []
            for k, (name, idx) in enumerate(mine.items()):
                out.append([streams[name], idx])
                if k % PACE == PACE - 1:
                    await trio.sleep(0)
        return plan, entries

    async def _replay(self, rec, backups, streams, plan) -> RecoveryPlan:
        """3. What the backups hold of the incarnation (one that does not answer fails this
        attempt: it may hold the only intact copy), its settled history re-pointed, the rest
        replayed into the new owners ``plan`` names, vlogs in parallel."""
        with rec.phase("list"):
            listings, floors = await list_backups(self.pool(), backups, rec.broker)
        addrs = {b.id: b.addr for b in backups}
        with rec.phase("plan"):
            replay_plan = RecoveryPlan(rec.broker, rec.epoch, listings, self._durable_vlogs(rec), floors,
                                       backup_copies(s.replication for s in streams.values()))
        rows, owners = [], {}
        for k, ((n, i), m) in enumerate(plan.items()):
            sid = streams[n].id
            rows.append((sid, i, m.addr, m.epoch))
            owners[(sid, i)] = m
            if k % PACE == PACE - 1:
                await trio.sleep(0)
        owners_of, routes = pack_routes(rows)
        rec.vlogs = len(replay_plan.vlogs)
        rec.total = replay_plan.total_bytes
        replay_from: list = []
        settle = None
        if self.settings.repoint_evicted:
            # compacted streams are never evicted (their segments are rewritten in memory): they
            # are replayed whole, so the new owner keeps compacting them
            got = await repoint(self.pool(), rec, replay_plan, addrs, owners, replayed={
                (streams[n].id, i) for (n, i) in plan if streams[n].compacted},
                newest=self.settings.chunk_rows_newest)
            replay_from, settle, rec.deferred = got.replay_from, got.settle, got.deferred
        # the groups adopted after the hand-over (this recovery's, and those a record still
        # holds for streamlets it hands over: ``kera.recovery.adoption``), told beside the replay
        pend = self.adoptions.pending_for(owners, (rec.broker, rec.epoch), rec.deferred)
        ask = {"broker": rec.broker, "owners": owners_of, "replay_from": replay_from}
        with rec.phase("replay"):
            async with trio.open_nursery() as n:
                if settle is not None:  # the adoptions made durable and claimed meanwhile
                    n.start_soon(settle)
                if pend:
                    n.start_soon(self.adoptions.pend, pend)
                for vlog in replay_plan.vlogs:
                    n.start_soon(self._replay_vlog, rec, replay_plan, vlog, addrs, ask, routes)
        rec.lost = [r.describe() for r in replay_plan.lost]
        for r in rec.lost:
            log.error("recovery of broker %d epoch %d: LOST vlog %d vseg %d bytes %d..%s (%s)",
                      rec.broker, rec.epoch, r["vlog"], r["vseg"], r["offset"],
                      "?" if r["end"] is None else r["end"], r["reason"])
        return replay_plan

    async def _replay_vlog(self, rec: Recovery, replay_plan: RecoveryPlan, vlog: int, addrs: dict,
                           ask: dict, routes) -> None:
        """One vlog's steps as the plan gives them out, each a ``replay`` of one copy from an
        offset (``ask``: what every step's request carries; ``routes``: its payload), until
        the plan says the log is done or ends early."""
        while isinstance(step := replay_plan.next_step(vlog), Step):
            rec.sources.add(step.backup)
            rec.steps += 1
            try:
                r = await self._call(addrs[step.backup], "replay", {
                    **ask, "vlog": vlog, "vseg": step.vseg, "offset": step.offset},
                    timeout=REPLAY_TIMEOUT, payload=routes)
            except KeraError as e:
                if getattr(e, "target", None):  # a new owner failed, not the copy: plan again
                    raise
                rec.failed_steps += 1
                log.warning("replay of vlog %d vseg %d from backup %d at offset %d failed (%s); "
                            "continuing from another copy", vlog, step.vseg, step.backup,
                            step.offset, e)
                replay_plan.step_done(vlog, step.vseg, step.backup, step.offset, FAILED)
                continue
            rec.chunks += r.get("chunks", 0)
            rec.bytes += r.get("bytes", 0)
            stopped = r.get("stopped", END)
            if stopped not in (END, CORRUPT, REFUSED):
                stopped = FAILED
            if stopped == CORRUPT:
                rec.corrupt_steps += 1
                log.warning("replay of vlog %d vseg %d from backup %d stopped at a corrupt chunk "
                            "at offset %d; continuing from another copy", vlog, step.vseg,
                            step.backup, r["next"])
            replay_plan.step_done(vlog, step.vseg, step.backup, int(r.get("next", step.offset)),
                                  stopped, r.get("corrupt_end"))
        if isinstance(step, Truncated):
            self._accept_truncation(rec, step)
        elif isinstance(step, Done) and step.head_closed:
            log.info("vlog %d of broker %d: its newest vseg %d is closed, its successor never "
                     "reached a backup", vlog, rec.broker, step.vseg)

    def _durable_vlogs(self, rec: Recovery) -> list[int]:
        """Vlogs the dead incarnation last reported with durable chunks (heartbeat stats).

        Such a vlog has copies somewhere: if no backup lists one, its copies
        are down or gone, which must not pass for a vlog that never existed.
        Unknown after a coordinator restart (then every known backup is
        waited for before recovering at all).
        """
        m = self.roster.incarnation(rec.broker, rec.epoch)
        if m is None or not isinstance(m.stats, dict):
            return []
        return [v["vlog"] for v in m.stats.get("vlogs", []) if v.get("durable", 0) > 0]

    def _accept_truncation(self, rec: Recovery, t: Truncated) -> None:
        """A log that ends early: fail this attempt while the missing bytes may still come back.

        They may be on a backup that is known but not up, or on a copy whose
        backup failed during this attempt; both are waited for up to the
        grace period (counted from the first attempt), then the loss is
        accepted and reported.
        """
        known = set(self.metadata.state.get("backups", []))
        up = {m.id for m in self.roster.live("backup")}
        waiting = sorted(known - up)
        first = self.first_try.get((rec.broker, rec.epoch), time.monotonic())
        if (waiting or t.failed) and time.monotonic() - first < self.grace:
            why = ([f"backups {waiting} are down"] if waiting else []) + \
                ([f"backups {sorted(t.failed)} failed"] if t.failed else [])
            raise LogIncomplete(f"vlog {t.vlog} ends at vseg {t.vseg} offset {t.offset} ({t.reason}); "
                                f"{' and '.join(why)}: they may hold the rest")

    async def _unassign(self, m, entries: list) -> None:
        """What a failed attempt assigned to ``m`` (its epoch named, as every coordinator
        request to a broker is; as many requests as the batch limit asks)."""
        try:
            for k in range(0, len(entries), MAX_BATCH_STREAMS):
                await self._call(m.addr, "unassign", {"epoch": m.epoch, "streams": [
                    [s.id, idx] for s, idx in entries[k:k + MAX_BATCH_STREAMS]]})
        except KeraError as e:
            log.info("unassign after a failed recovery: %s", e)

    async def _call(self, addr, method, meta, timeout=30.0, payload=b""):
        r, _ = await self.pool().call(addr, method, meta, payload, timeout=timeout)
        return r

    async def _quiet(self, addr, method, meta) -> None:
        try:
            await self._call(addr, method, meta)
        except KeraError as e:
            log.info("%s on %s failed: %s", method, addr, e)

    def describe(self) -> list[dict]:
        """Active recoveries, those waiting for backups, the last five, and every remembered
        one that lost data."""
        recent = self.history[-5:]
        lossy = [r for r in self.losses if r not in recent]
        waiting = [r for key, (r, _) in self.waiting.items() if key not in self.active]
        return [r.describe() for r in list(self.active.values()) + waiting + lossy + recent]
