"""Which copy to replay each chunk of a dead incarnation's virtual logs from.

Pure decisions (no I/O, no trio, no clock), driven by ``kera.recovery.manager``:

- Input: what each backup listed of the incarnation (``Replica.info()`` per
  copy: length, chunks, closed, corrupt regions, checksum; or a ``Listing``,
  the closed intact copies as rows of columns).
- Copies of one virtual segment (vseg) are byte-identical prefixes of the
  same byte stream, so the chunk at offset X can be read from any copy that
  is longer than X and holds X intact. A copy is never chosen for its length
  alone: a long copy corrupt early is worth less than a short intact one.
- A vlog is replayed vseg after vseg, one step at a time: a step asks one
  backup to replay one copy from an offset until the copy ends or reaches a
  corrupt chunk; the next step continues at the offset where it stopped,
  from whichever copy holds the next bytes intact (spreading steps over
  backups so that many read at once).
- Where a log starts: at vseg 0, or at the *floor* the broker recorded on
  the backups when retention released the vsegs below it (nothing in them
  was live; their files are deleted), so those are not holes.
- Where a log ends: after the last vseg, when no copy holds the next chunk
  intact, when a vseg id is missing (ids start at 0 and have no holes), or
  when the new owner refuses a chunk (a hole in its group). Everything from
  there on is reported as lost, with its exact range.

Usage (one driver loop per vlog, vlogs in parallel)::

    plan = RecoveryPlan(broker, epoch, {backup_id: segments, ...})
    while isinstance(step := plan.next_step(vlog), Step):
        ... replay step.vseg from step.backup at step.offset ...
        plan.step_done(vlog, step.vseg, step.backup, stopped_at, reason)
    # step is now Done or Truncated
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import ProtocolError
from ..vlog import vlog_epoch
from ..wire.columns import PLAIN_COLUMNS

END = "end"          # the copy has nothing more (its length)
CORRUPT = "corrupt"  # the next chunk of the copy failed verification
FAILED = "failed"    # the backup or its copy failed (error, timeout, gone)
REFUSED = "refused"  # the new owner refused the chunk: a hole in its group before it
REASONS = (END, CORRUPT, FAILED, REFUSED)


def backup_copies(replications: Iterable[int]) -> int:
    """The backup copies a chunk of an incarnation's vlogs was acknowledged on, from its
    streams' replication factors: its least replicated vlog's (vlogs never mix factors)."""
    return min((max(1, r - 1) for r in replications), default=1)


class PlanError(ValueError):
    """The driver broke the protocol (a step reported that was not given out)."""


@dataclass(frozen=True, slots=True)
class Step:
    """Replay ``vseg`` from the copy on ``backup``, starting at ``offset``.

    ``until`` is where the copy is expected to stop (its length or its next
    known corrupt region); the backup may stop earlier.
    """

    vlog: int
    vseg: int
    backup: int
    offset: int
    until: int


@dataclass(frozen=True, slots=True)
class LostRange:
    """Bytes of a vseg that no copy could deliver; ``end`` None: extent unknown (no copy at all)."""

    vlog: int
    vseg: int
    offset: int
    end: int | None
    reason: str

    def describe(self) -> dict:
        return {"vlog": self.vlog, "vseg": self.vseg, "offset": self.offset, "end": self.end,
                "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Done:
    """The vlog was replayed completely, up to (vseg, offset).

    ``head_closed``: its newest vseg was closed, so its successor never
    reached a backup (nothing in it was acknowledged).
    """

    vlog: int
    vseg: int
    offset: int
    head_closed: bool = False


@dataclass(frozen=True, slots=True)
class Truncated:
    """The vlog was replayed up to (vseg, offset) and no further; ``lost`` says what is left.

    ``failed``: backups whose copy could have held the next bytes but failed
    during a step (a retried attempt may still read them).
    """

    vlog: int
    vseg: int
    offset: int
    reason: str
    lost: tuple[LostRange, ...]
    failed: frozenset[int] = frozenset()


@dataclass(slots=True)
class _Copy:
    backup: int
    length: int
    chunks: int
    closed: bool
    checksum: int | None
    regions: list[tuple[int, int]] = field(default_factory=list)  # corrupt [start, end), sorted
    failed: bool = False

    @property
    def final(self) -> bool:
        """Closed, with nothing of unknown extent: its length is the vseg's length for sure."""
        return self.closed and (not self.regions or all(end <= self.length for _, end in self.regions))

    def run(self, offset: int) -> int:
        """Intact bytes readable from ``offset`` on (0: cannot serve ``offset``)."""
        if self.failed or offset >= self.length:
            return 0
        for start, end in self.regions:
            if start <= offset < end:
                return 0
            if start > offset:
                return start - offset
        return self.length - offset

    def add_region(self, start: int, end: int) -> None:
        self.regions.append((start, max(end, start + 1)))
        self.regions.sort()


@dataclass(slots=True)
class _Vlog:
    id: int
    vsegs: dict[int, list[_Copy]]
    vseg: int = 0
    offset: int = 0
    step: Step | None = None
    outcome: Done | Truncated | None = None
    steps: int = 0
    corrupt_steps: int = 0
    failed_steps: int = 0
    floor: int = 0     # the vsegs below were released by the broker
    skip: set[int] = field(default_factory=set)  # settled vsegs whose chunks are all re-pointed
    prefix: tuple | None = None   # (vseg, its settled prefix from there), before any step
    top: int = -1      # the highest vseg listed (the listings are all there is: it never moves)
    lengths: dict[int, int] = field(default_factory=dict)   # vseg -> ``_length``, until a step on it


@dataclass(frozen=True, slots=True)
class Listing:
    """One backup's ``list`` of a broker's copies asked as columns: maps (``Replica.info``)
    for the copies that are open, corrupt or failing, and a row of ``PLAIN_COLUMNS`` u64s
    (vlog, vseg, length, chunks, checksum) for each closed, intact one: most of a long
    history, decoded as one array instead of a map each."""

    segments: list
    plain: np.ndarray

    @classmethod
    def of(cls, meta: dict, payload) -> Listing:
        """From the answer; a malformed one raises ``ProtocolError`` (a backup from before
        columns answers maps only, ``plain`` absent)."""
        segments, n = meta.get("segments"), meta.get("plain", 0)
        size = len(payload)
        if not isinstance(segments, list) or type(n) is not int or size != n * 8 * PLAIN_COLUMNS:
            raise ProtocolError(f"a listing of {n!r} rows of columns in {size} bytes")
        return cls(segments, np.frombuffer(payload, "<u8").reshape(-1, PLAIN_COLUMNS))


class RecoveryPlan:
    """The replay plan of one dead incarnation (broker, epoch), all of its vlogs."""

    def __init__(self, broker: int, epoch: int, listings: Mapping[int, Iterable[dict] | Listing],
                 expected: Iterable[int] = (), floors: Mapping[int, int] | None = None,
                 need: int = 1):
        """``expected``: vlogs known to hold durable chunks (the broker said so while alive);
        one that no backup listed has lost everything, rather than never existed.
        ``floors``: per vlog, the vsegs below it were released (retention), not lost.
        ``need``: the backup copies a chunk is acknowledged on (R - 1); a settled vseg with
        fewer whole copies is indexed only once its bodies are read and verified
        (``kera.recovery.indexing``): rot a listing cannot show (a flipped bit in a chunk's
        body) may sit in its one copy, where an adopted segment would name a chunk nobody
        can read."""
        self.broker, self.epoch, self.need = broker, epoch, need
        floors = {v: f for v, f in (floors or {}).items() if vlog_epoch(v) == epoch and f > 0}
        self._vlogs: dict[int, _Vlog] = {v: _Vlog(v, {}) for v in expected if vlog_epoch(v) == epoch}
        for v, f in floors.items():
            self._vlogs.setdefault(v, _Vlog(v, {})).vseg = f
            self._vlogs[v].floor = f
        at: dict[int, tuple | None] = {}   # vlog -> (its vsegs' copies, its floor); None: not ours

        def add(vlog: int, vseg: int, copy: _Copy) -> None:
            if vlog not in at:
                at[vlog] = None if vlog_epoch(vlog) != epoch else \
                    (self._vlogs.setdefault(vlog, _Vlog(vlog, {})).vsegs, floors.get(vlog, 0))
            if (vs := at[vlog]) is not None and vseg >= vs[1]:   # below its floor: released, the
                vs[0].setdefault(vseg, []).append(copy)           # file is on its way out

        for backup, listing in sorted(listings.items()):
            segments, plain = (listing.segments, listing.plain.tolist()) if isinstance(listing, Listing) \
                else (listing, [])
            for sg in segments:
                if sg["broker"] != broker:
                    continue
                corrupt = sg.get("corrupt")
                regions = sorted((int(c["offset"]), int(c["offset"]) + int(c["length"]))
                                 for c in corrupt) if corrupt else []
                add(sg["vlog"], int(sg["vseg"]), _Copy(backup, int(sg["length"]), int(sg.get("chunks", 0)),
                                                       bool(sg.get("closed")), sg.get("checksum"), regions))
            for vlog, vseg, length, chunks, checksum in plain:   # most of a long history
                add(vlog, vseg, _Copy(backup, length, chunks, True, checksum, []))
        for v in self._vlogs.values():
            v.top = max(v.vsegs, default=-1)
        self.busy: dict[int, int] = {}      # steps out per backup
        self.assigned: dict[int, int] = {}  # bytes given to each backup so far

    # -- what there is ---------------------------------------------------------------
    @property
    def vlogs(self) -> list[int]:
        return sorted(self._vlogs)

    def vseg_length(self, vlog: int, vseg: int) -> int:
        """The known length of a vseg: a closed copy's, else the longest copy's (corrupt
        bytes included); nothing lies past the close, whatever a damaged copy claims."""
        return _known(self._vlogs[vlog], vseg)

    @property
    def total_bytes(self) -> int:
        return sum(_known(v, s) for v in self._vlogs.values() for s in v.vsegs)

    # -- re-pointing (settled history stays on the backups) ----------------------------
    def settled(self, vlog: int, any_whole: bool = False) -> list[tuple[int, list[int]]]:
        """The vlog's settled prefix from its floor: (vseg, backups holding it whole), for
        vsegs of which every copy listed is closed, of full length and with no corrupt
        region, up to the first that is not. Only chunks in it may be re-pointed: a whole
        intact copy lists every chunk of the vseg, so no chunk of a re-pointed segment can be
        missing from the index; and an adopted segment names only these copies, so a vseg
        with another copy (shorter, open, or corrupt elsewhere) is replayed, which reads
        each chunk from any copy holding it intact, rather than lose that copy.
        ``any_whole``: up to the first vseg with no whole intact copy, however many others
        are short or corrupt (the adoption after a hand-over, which can no longer replay)."""
        v = self._vlog(vlog)
        if any_whole:   # still a prefix: a vseg missing in the middle must not pass for freed
            out, s = [], v.vseg
            while (copies := v.vsegs.get(s)) is not None:
                end = _known(v, s)
                whole = [c.backup for c in copies if c.final and not c.regions and c.length == end
                         and not c.failed]
                if not whole:
                    break
                out.append((s, sorted(whole)))
                s += 1
            return out
        if v.prefix is not None and v.prefix[0] == v.vseg and not v.steps:   # no copy changed since
            return list(v.prefix[1])
        out, s = [], v.vseg
        while (copies := v.vsegs.get(s)) is not None:
            end = _known(v, s)
            whole = [c.backup for c in copies if c.final and not c.regions and c.length == end
                     and not c.failed]
            if not whole or len(whole) < sum(not c.failed for c in copies):
                break
            out.append((s, sorted(whole)))
            s += 1
        if not v.steps:
            v.prefix = (v.vseg, out)
        return list(out)

    def skip(self, vlog: int, vsegs: Iterable[int]) -> None:
        """Do not replay these vsegs (all in the settled prefix, not started yet)."""
        v = self._vlog(vlog)
        vsegs = set(vsegs)
        settled = {s for s, _ in self.settled(vlog)}
        if not vsegs <= settled or v.steps or v.offset:
            raise PlanError(f"vlog {vlog}: only settled vsegs may be skipped, before replay")
        v.skip |= vsegs

    # -- the state machine ----------------------------------------------------------
    def next_step(self, vlog: int) -> Step | Done | Truncated:
        """The next replay step of ``vlog``, or how it ended. One step at a time per vlog."""
        v = self._vlog(vlog)
        if v.outcome is not None:
            return v.outcome
        if v.step is not None:
            raise PlanError(f"vlog {vlog}: step {v.step} is still out")
        while True:
            copies = v.vsegs.get(v.vseg)
            if copies is None:
                if not v.vsegs and v.floor and v.vseg == v.floor:
                    v.outcome = Done(vlog, v.floor, 0, False)  # everything in it was released
                    return v.outcome
                if not v.vsegs:
                    return self._truncate(v, "missing", "no copy of any of its vsegs")
                if v.top > v.vseg:
                    return self._truncate(v, "missing", f"vseg {v.vseg} has no copy")
                last = v.top
                closed = any(c.final for c in v.vsegs[last])
                v.outcome = Done(vlog, last, self.vseg_length(vlog, last), closed)
                return v.outcome
            end = _known(v, v.vseg)
            if v.offset == 0 and v.vseg in v.skip:
                v.offset = end  # every chunk in it was re-pointed (or belongs to nobody recovered)
            if v.offset >= end:
                if v.top > v.vseg and not any(c.final for c in copies):
                    # an open vseg followed by others: a vlog's durable head passes a vseg only
                    # once its copies acknowledged its close, so nothing after was acknowledged
                    v.outcome = Done(vlog, v.vseg, end, False)
                    return v.outcome
                v.vseg, v.offset = v.vseg + 1, 0
                continue
            runs = [(c, min(c.run(v.offset), end - v.offset)) for c in copies]
            cands = [(c, r) for c, r in runs if r > 0]
            if not cands:
                return self._truncate(v, "no intact copy", f"no copy holds vseg {v.vseg} at "
                                      f"offset {v.offset} intact")
            # least busy backup first, then the one given least so far, then the longest run
            c, r = min(cands, key=lambda cr: (self.busy.get(cr[0].backup, 0),
                                               self.assigned.get(cr[0].backup, 0), -cr[1],
                                               cr[0].backup))
            v.step = Step(vlog, v.vseg, c.backup, v.offset, v.offset + r)
            v.steps += 1
            self.busy[c.backup] = self.busy.get(c.backup, 0) + 1
            self.assigned[c.backup] = self.assigned.get(c.backup, 0) + r
            return v.step

    def step_done(self, vlog: int, vseg: int, backup: int, stopped_at: int, reason: str,
                  resume_at: int | None = None) -> None:
        """The step on ``backup`` stopped at ``stopped_at`` (everything before it was placed).

        ``reason`` is END, CORRUPT (``resume_at``: where the corrupt region ends,
        when known), FAILED (``stopped_at`` is then the last offset known to be
        placed, the step's start if unsure) or REFUSED.
        """
        v = self._vlog(vlog)
        st = v.step
        if st is None or st.vseg != vseg or st.backup != backup:
            raise PlanError(f"vlog {vlog}: no step out on vseg {vseg} from backup {backup}")
        if reason not in REASONS:
            raise PlanError(f"unknown reason {reason!r}")
        copy = next(c for c in v.vsegs[vseg] if c.backup == backup)
        if not st.offset <= stopped_at <= copy.length:
            raise PlanError(f"vlog {vlog} vseg {vseg}: stopped at {stopped_at}, outside "
                            f"[{st.offset}, {copy.length}]")
        v.step = None
        v.lengths.pop(vseg, None)   # the copy's length or regions change below
        self.busy[backup] -= 1
        v.offset = stopped_at
        if reason == END:
            copy.length = stopped_at  # shorter than listed: nothing more to read from it
        elif reason == CORRUPT:
            v.corrupt_steps += 1
            end = resume_at if resume_at is not None and resume_at > stopped_at else copy.length
            copy.add_region(stopped_at, end)
        elif reason == FAILED:
            v.failed_steps += 1
            copy.failed = True
        else:
            self._truncate(v, "refused", f"the new owner refused the chunk at vseg {vseg} "
                           f"offset {stopped_at}: its group has a hole before it")

    # -- results ----------------------------------------------------------------------
    def outcome(self, vlog: int) -> Done | Truncated | None:
        return self._vlog(vlog).outcome

    @property
    def finished(self) -> bool:
        return all(v.outcome is not None for v in self._vlogs.values())

    @property
    def complete(self) -> bool:
        """Every vlog was replayed to its end: the copies may be dropped after hand-over."""
        return all(isinstance(v.outcome, Done) for v in self._vlogs.values())

    def covered(self) -> list[list[int]]:
        """[[vlog, last vseg], ...]: what a complete replay went through, per vlog. Only files
        within it may go: a vlog or vseg the listings never showed (its copies on backups down
        then) may hold all there is of it."""
        return [[v.id, v.outcome.vseg] for v in self._in_order() if isinstance(v.outcome, Done)]

    @property
    def lost(self) -> list[LostRange]:
        return [r for v in self._in_order() if isinstance(v.outcome, Truncated) for r in v.outcome.lost]

    def _in_order(self) -> list[_Vlog]:
        """The vlogs by id, however the listings came."""
        return [self._vlogs[k] for k in sorted(self._vlogs)]

    def counts(self) -> dict:
        vs = self._vlogs.values()
        return {"steps": sum(v.steps for v in vs), "corrupt_steps": sum(v.corrupt_steps for v in vs),
                "failed_steps": sum(v.failed_steps for v in vs)}

    # -- internals ----------------------------------------------------------------------
    def _vlog(self, vlog: int) -> _Vlog:
        v = self._vlogs.get(vlog)
        if v is None:
            raise PlanError(f"vlog {vlog} is not part of this plan")
        return v

    def _truncate(self, v: _Vlog, reason: str, why: str) -> Truncated:
        lost = []
        copies = v.vsegs.get(v.vseg)
        lost.append(LostRange(v.id, v.vseg, v.offset, _length(copies) if copies else None, why))
        for s in range(v.vseg + 1, max(v.top, v.vseg) + 1):
            cs = v.vsegs.get(s)
            lost.append(LostRange(v.id, s, 0, _length(cs) if cs else None,
                                  f"after the end at vseg {v.vseg} offset {v.offset}"
                                  if cs else f"vseg {s} has no copy"))
        failed = frozenset(c.backup for c in copies or [] if c.failed and c.length > v.offset)
        v.outcome = Truncated(v.id, v.vseg, v.offset, reason, tuple(lost), failed)
        return v.outcome


def _known(v: _Vlog, vseg: int) -> int:
    """``_length`` of ``v``'s copies of ``vseg``, kept until a step on it changes a copy."""
    n = v.lengths.get(vseg)
    if n is None:
        n = v.lengths[vseg] = _length(v.vsegs[vseg])
    return n


def _length(copies: list[_Copy]) -> int:
    final = [c.length for c in copies if c.final]
    return min(final) if final else max(c.length for c in copies)
