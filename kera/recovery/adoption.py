"""Adopting a dead broker's closed history after its streamlets serve again (coordinator side).

A recovery re-points the settled history of a dead incarnation instead of replaying it
(``kera.recovery.repoint``). The groups whose adoption reaches their end (``Repoint.ended``: closed,
every segment settled, nothing of them replayed) are most of a long history, and nothing
the replay places depends on them, so the hand-over does not wait for them: the time to
serve stays that of the replay, however long the history. What makes that safe:

- **Reads wait, nothing is skipped.** Before the hand-over each new owner is told the
  groups still to come (``pend``, beside the replay): a read that reaches one is refused
  as ``recovering`` (clients retry), a consumer from latest takes them as read, retention
  frees nothing on that streamlet, and no new group takes their ids. Producers' highest
  sequences in them come with it, so a resend of one of their chunks stays a duplicate.
- **It survives failures.** The hand-over commit records the pending adoption
  (``deferred``: the incarnation, its streamlets' groups and sequences, what
  ``kera.coordinator.recovered`` needs after), in place of the incarnation's *recovered* entry, so
  its files stay on the backups. The record is written before the owners in the same
  commit (etcd's batches put it first), so it never goes missing while they are stored.
  ``Adoptions`` then does the work from the record alone: the backups' listings, the
  settled vsegs' index, the plan, restricted to the pending groups, adopted into whoever
  owns each streamlet now, made durable and claimed (``settle``), the groups released
  (``pend`` with none), then the record replaced by the recovered entry in one commit.
  A new owner that dies meanwhile is recovered as any broker, and its recovery tells its
  successor the groups still pending, from the record; a new coordinator term finds the
  record and starts over. Every step is idempotent (``pend`` sets, ``adopt`` of a held
  segment is a no-op that claims again).
- **A record waits** while its incarnation still owns streamlets (its recovery is not
  handed over), or while an owner of its streamlets is not alive (its own recovery will
  name the successor); streamlets of streams deleted meanwhile are dropped from it.

A pending group the plan cannot adopt (its copies are down or gone) keeps the record:
it is tried again, the reads of that streamlet keep waiting, and ``kera status`` shows
it with the error, rather than a consumer skipping a group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import trio

from .. import failpoints
from ..errors import Unavailable
from .listing import list_backups
from .needs import Liveness, MetaStore, RecoveredList
from .plan import RecoveryPlan, backup_copies
from .repoint import repoint
from .state import Recovery

log = logging.getLogger("kera.recovery")

RETRY = 1.0          # seconds between looks at the records (sooner when poked)
MAX_RETRY = 30.0     # a record whose adoption keeps failing is tried again at most this late
TIMEOUT = 30.0


def key_of(broker: int, epoch: int) -> str:
    return f"{broker}:{epoch}"


def ranges(ids) -> list[list[int]]:
    """Group ids as [lo, hi] ranges: a closed history's groups are mostly consecutive, so a
    record and a ``pend`` stay small however long the history."""
    out: list[list[int]] = []
    for g in sorted(ids):
        if out and g == out[-1][1] + 1:
            out[-1][1] = g
        else:
            out.append([g, g])
    return out


def ids(rs) -> set[int]:
    return {g for lo, hi in rs for g in range(lo, hi + 1)}


def _kafka_end(rest: list) -> int:
    """The Kafka end offset a record's streamlet entry carries after its four fields (0 in a
    record written before it was kept)."""
    return int(rest[0]) if rest else 0


class Adoptions:
    """The coordinator's pending adoptions (``meta["deferred"]``) and the task doing them.
    Handed the term's ``roster``, ``metadata`` (the records, the streams, commits),
    ``recovered`` (an incarnation adopted whole is let go of) and the coordinator's
    ``pool()``."""

    def __init__(self, roster: Liveness, metadata: MetaStore, recovered: RecoveredList, pool: Callable):
        self.roster, self.metadata, self.recovered, self.pool = roster, metadata, recovered, pool
        self.wake = trio.Event()
        self.state: dict[str, dict] = {}   # record key -> its last try (error)
        self.due: dict[str, tuple[float, float]] = {}   # record key -> (next try, backoff)

    @property
    def records(self) -> dict:
        return self.metadata.state["deferred"]

    def poke(self) -> None:
        """A hand-over or a membership change: every record is worth a try again now."""
        self.due.clear()
        self.wake.set()

    def has(self, broker: int, epoch: int) -> bool:
        return key_of(broker, epoch) in self.records

    def record(self, broker: int, epoch: int, deferred: dict, covered: list, complete: bool,
               handed: Iterable = ()) -> None:
        """At a hand-over of ``handed`` ((stream id, streamlet) pairs): ``deferred`` ((stream
        id, streamlet) -> (groups, highest sequences, a producer per group, [Kafka end])) of the
        incarnation is adopted after it (durable with the hand-over's commit). A record of the
        same incarnation (an earlier hand-over of other streamlets of it, whose commit was cut
        short) is merged into: its other streamlets' groups are still pending, the handed
        ones are as this plan says; what a replay covered is the smaller, complete only if
        both were. The sequences are not kept (a successor learns them from the adoption);
        the end of the pending groups' Kafka offsets is (``pend`` again, after a new term or
        a failed try, tells the owner where appends go on before the adoption brings them)."""
        k = key_of(broker, epoch)
        old = self.records.get(k)
        kept = {(sid, i): (rs, tops, _kafka_end(e)) for sid, i, rs, tops, *e in (old or {}).get("streamlets", [])}
        for key in handed:
            kept.pop(key, None)
        for key, (gs, _, producers, kafka) in deferred.items():
            kept[key] = (ranges(gs), self._tops(key[0], producers), kafka[0])
        if old is not None:
            low = dict(old["covered"])
            covered = sorted([v, min(low.get(v, last), last)] for v, last in covered)
            complete = complete and old["complete"]
        self.metadata.set(("deferred", k), {
            "broker": broker, "epoch": epoch, "covered": covered, "complete": complete,
            "streamlets": [[sid, i, rs, tops, kafka] for (sid, i), (rs, tops, kafka) in sorted(kept.items())]})

    def _tops(self, stream_id: int, producers: dict[int, int]) -> list[list[int]]:
        """[[slot, newest group], ...] of pending groups (``producers``: group -> a producer)."""
        s = self.metadata.streams.by_id(stream_id)
        q = s.groups if s is not None else 1
        tops: dict[int, int] = {}
        for g, p in producers.items():
            tops[p % q] = max(tops.get(p % q, -1), g)
        return sorted([slot, g] for slot, g in tops.items())

    def pending_for(self, owners: dict, own: tuple[int, int] | None = None, deferred: dict | None = None) -> dict:
        """What the new ``owners`` ((stream id, streamlet) -> member) of a recovery are to wait
        for: (member, source incarnation) -> pend entries; the recovery's own ``deferred``
        (source ``own``), and the groups of every record on streamlets it hands over."""
        out: dict = {}
        for (sid, i), (gs, hs, producers, kafka) in (deferred or {}).items():
            m = owners[(sid, i)]
            out.setdefault((m, own), []).append([sid, i, ranges(gs), sorted(hs.items()),
                                                 self._tops(sid, producers), kafka[0]])
        for r in self.records.values():
            src = (r["broker"], r["epoch"])
            for sid, i, rs, tops, *e in r["streamlets"]:
                m = owners.get((sid, i))
                if m is not None and src != own:
                    out.setdefault((m, src), []).append([sid, i, rs, [], tops, _kafka_end(e)])
        return out

    async def pend(self, calls: dict) -> None:
        """``pending_for``'s answer sent, all in parallel; raises if one fails."""
        async with trio.open_nursery() as n:
            for (m, src), entries in calls.items():
                n.start_soon(self._call, m, "pend", {"source": list(src), "entries": entries})

    async def _call(self, m, method: str, meta: dict) -> None:
        await self.pool().call(m.addr, method, {"epoch": m.epoch, **meta}, timeout=TIMEOUT)

    def describe(self) -> list[dict]:
        return [{"broker": r["broker"], "epoch": r["epoch"],
                 "streamlets": len(r["streamlets"]),
                 "groups": sum(hi - lo + 1 for _, _, rs, *_ in r["streamlets"] for lo, hi in rs),
                 **self.state.get(k, {})} for k, r in sorted(self.records.items())]

    async def run(self) -> None:
        while True:
            with trio.move_on_after(RETRY):
                await self.wake.wait()
            self.wake = trio.Event()
            if not self.roster.ready:
                continue
            for k in sorted(self.records):
                r = self.records.get(k)
                if r is None or self.due.get(k, (0, 0))[0] > time.monotonic() or not self._ready(k, r):
                    continue
                r = self.records[k]   # less the streamlets of streams deleted meanwhile
                t = time.monotonic()
                try:
                    await self._adopt(k, r)
                except Exception as e:  # noqa: BLE001 (tried again from the record, whatever broke)
                    while isinstance(e, ExceptionGroup) and e.exceptions:  # the first cause says it best
                        e = e.exceptions[0]
                    self.state[k] = {"error": f"{type(e).__name__}: {e}"}
                    wait = min(MAX_RETRY, 2 * self.due.get(k, (0, RETRY / 2))[1])
                    self.due[k] = (time.monotonic() + wait, wait)
                    log.warning("adoption of broker %d epoch %d's closed history failed, tried again "
                                "in %.0f s: %s", r["broker"], r["epoch"], wait, e)
                    continue
                self.state.pop(k, None)
                self.due.pop(k, None)
                log.info("broker %d epoch %d: closed history adopted after the hand-over in %.3f s",
                         r["broker"], r["epoch"], time.monotonic() - t)

    def _ready(self, k: str, r: dict) -> bool:
        """The incarnation is handed over, every streamlet of the record is owned by a live
        broker; streamlets of deleted streams are dropped (the record with them, if none is left)."""
        md = self.metadata
        if md.holdings.count((r["broker"], r["epoch"])):
            return False
        live = {sid: s for sid in {e[0] for e in r["streamlets"]}
                if (s := md.streams.by_id(sid)) is not None}
        kept = [e for e in r["streamlets"] if e[0] in live]
        if len(kept) != len(r["streamlets"]):
            md.set(("deferred", k), {**r, "streamlets": kept})
        for sid, i, *_ in kept:
            owner = live[sid].owners[i]
            if owner is None or self.roster.live_broker(*owner) is None:
                return False
        return True

    async def _adopt(self, k: str, r: dict) -> None:
        md = self.metadata
        broker, epoch = r["broker"], r["epoch"]
        live = {sid: md.streams.by_id(sid) for sid in {e[0] for e in r["streamlets"]}}
        owners, only, pending = {}, {}, {}
        for sid, i, rs, tops, *e in r["streamlets"]:
            owners[(sid, i)] = self.roster.live_broker(*live[sid].owners[i])
            only[(sid, i)] = ids(rs)
            pending[(sid, i)] = (rs, tops, _kafka_end(e))
        if owners:
            await failpoints.hit("adoption.start", k)
            calls: dict = {}
            for (sid, i), m in owners.items():
                rs, tops, kafka = pending[(sid, i)]
                calls.setdefault((m, (broker, epoch)), []).append([sid, i, rs, [], tops, kafka])
            await self.pend(calls)   # again: a new term or a retry starts from the record
            await self._repoint(broker, epoch, owners, only,
                                backup_copies(s.replication for s in live.values()))
            async with trio.open_nursery() as n:
                for (m, src), entries in calls.items():
                    n.start_soon(self._call, m, "pend", {"source": list(src),
                                                         "entries": [[sid, i, [], [], []] for sid, i, *_ in entries]})
        md.delete(("deferred", k))
        if r["complete"]:
            self.recovered.add(broker, epoch, r["covered"])
        await md.commit()

    async def _repoint(self, broker: int, epoch: int, owners: dict, only: dict, need: int) -> None:
        """The pending groups adopted from the backups' copies, durable and claimed (``need``:
        the backup copies their chunks were acknowledged on, ``RecoveryPlan``'s)."""
        backups = self.roster.live("backup")
        listings, floors = await list_backups(self.pool(), backups, broker)
        rec = Recovery(broker, epoch, [])   # repoint's phase timers and counters
        plan = RecoveryPlan(broker, epoch, listings, [], floors, need)
        got = await repoint(self.pool(), rec, plan, {b.id: b.addr for b in backups}, owners, only=only)
        missing = {(sid, i, g) for (sid, i), gs in only.items() for g in gs} - got.ended
        if missing:
            raise Unavailable(f"{len(missing)} pending groups cannot be adopted from the copies "
                              f"listed now (first: stream {min(missing)[0]} streamlet "
                              f"{min(missing)[1]} group {min(missing)[2]}); a backup holding "
                              f"them may be down")
        await got.settle()
