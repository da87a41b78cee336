"""Segments taken over from a dead broker as evicted: their chunks stay on its backups.

A recovery may hand a new owner a dead broker's settled history as index
chunks instead of chunk bodies (``kera.recovery.repoint_plan``, ``kera.recovery.index_chunk``).
Such a segment is built evicted (no buffer): per chunk its end, the dead
incarnation's vseg holding it and its offset there. Its vsegs are *foreign*:
named by (dead broker, vlog, vseg), with the backups that listed a whole
closed copy; never written again, never re-replicated (frozen), and not part
of any vlog of ours, so our floors and trims never touch them. Reads go
through ``kera.broker.tiered`` like any evicted segment, verified the same way.

Two things keep an adoption sound:

- **Durable.** The index chunk (one per run of consecutive segments of a
  group) is appended to the group's own vlog (``IndexHolder``); the
  recovery's ``settle`` is answered once it is durable, and the streamlet
  serves only after that: a recovery of this broker finds it there and
  adopts the segments again.
- **Claimed.** Backups delete a dead incarnation's files once its recovery
  dropped them and no owner *claims* them (``kera.backup.claims``). This
  owner claims each foreign vseg before answering ``settle`` (the recovery
  is recorded, and the files let go, only after), and releases it once no
  index chunk of ours naming it can be replayed any more: the holder's vseg
  is below our vlog's floor (its segment was freed, and so was everything
  else in that vseg). Until then a recovery of ours may adopt it again, so
  its files must stay.
"""

from __future__ import annotations

import logging
from array import array

import numpy as np
import trio

from ..errors import DataLoss, Fenced, KeraError, ProtocolError, Unavailable
from ..recovery.index_chunk import KAFKA, RECORDS, SegmentIndex
from .segment import Segment, VlogChunk

log = logging.getLogger("kera.broker")

CLAIM_TIMEOUT = 10.0
Key = tuple[int, int, int]   # (dead broker, vlog, vseg)


class ForeignVlog:
    """Stands in for a replicator on an adopted segment: everything in it is settled."""

    __slots__ = ("id", "broker", "open")

    def __init__(self, broker: int, vlog: int):
        self.broker, self.id, self.open = broker, vlog, None

    @property
    def log(self) -> ForeignVlog:
        return self

    def done(self, vs) -> bool:
        return True

    def close_open(self, durable: bool = True) -> bool:
        return False


class ForeignVseg:
    """A closed vseg of a dead incarnation, read by (broker, vlog, id) from ``copies``;
    ``holders``: our index chunks naming it that a recovery of ours could still replay."""

    __slots__ = ("id", "broker", "vlog", "copies", "live", "frozen", "closed", "holders", "claimed")

    def __init__(self, broker: int, vlog: int, id: int, copies):
        self.broker, self.vlog, self.id = broker, vlog, id
        self.copies = {int(b): None for b in copies}
        self.live = 0
        self.frozen = True
        self.closed = True
        self.holders = 0
        self.claimed = False

    @property
    def key(self) -> Key:
        return (self.broker, self.vlog, self.id)


class IndexHolder(VlogChunk):
    """An index chunk's bytes in our vlog; the vseg of ours holding it counts each segment
    it adopted in its ``live`` (until retention frees that segment, ``Claims.free``)."""

    __slots__ = ("segments",)

    def __init__(self, data: bytes, segments: int):
        super().__init__(data)
        self.segments = segments

    def noted(self, vlog, vs, vseg_offset: int) -> None:
        self.vs = vs
        vs.live += self.segments


class AdoptedSegment(Segment):
    __slots__ = ("holder", "foreign", "kafka")   # kafka: its rows' Kafka columns, until indexed


def adopted_segments(ix: SegmentIndex, capacity: int, claims: Claims) -> list[AdoptedSegment]:
    """The run's segments, evicted, from its index (not attached to anything yet): the rows
    are converted once per run, each segment takes its slices."""
    vlog = ForeignVlog(ix.source, ix.vlog)
    ends = ix.rows[:, 0].tolist()
    places = array("Q", np.ascontiguousarray(ix.rows[:, 1:3], np.uint64).tobytes())
    foreign = {v: claims.vseg(ix.source, ix.vlog, v, ix.copies[v])
               for v in dict.fromkeys(places[0::2])}
    out = []
    at = 0
    for i, c in enumerate(ix.counts):
        seg = AdoptedSegment.gone(ix.segment + i)
        seg.capacity = capacity
        seg.freed = False
        seg.evicted = True
        seg.ends = ends[at:at + c]
        seg.head = seg.durable = seg.ends[-1]
        seg.vplaces = places[2 * at:2 * (at + c)]
        seg.vlog = vlog
        seg.vsegs = [foreign[v] for v in dict.fromkeys(seg.vplaces[0::2])]
        seg.foreign = list(seg.vsegs)
        seg.holder = None
        seg.kafka = (ix.rows[at:at + c, KAFKA], ix.rows[at:at + c, RECORDS])
        out.append(seg)
        at += c
    return out


class Claims:
    """This broker's foreign vsegs, and the claims on the backups that keep their files."""

    def __init__(self, pool, identity, addr_of):
        self.pool = pool
        self.identity = identity    # () -> (broker id, epoch): the claiming owner
        self.addr_of = addr_of      # backup id -> address (raises Unavailable if not alive)
        self.vsegs: dict[Key, ForeignVseg] = {}
        self.freed: list[AdoptedSegment] = []   # freed adopted segments whose holder is still replayable
        self.lock = trio.Lock()     # claims and releases reach the backups in the order decided
        self.pending: dict[ForeignVseg, None] = {}   # adopted, to claim before the hand-over
        self.released = 0           # foreign vsegs released, ever

    def vseg(self, broker: int, vlog: int, vseg: int, copies) -> ForeignVseg:
        key = (broker, vlog, vseg)
        vs = self.vsegs.get(key)
        if vs is None:
            vs = self.vsegs[key] = ForeignVseg(broker, vlog, vseg, copies)
        else:
            new = [int(b) for b in copies if int(b) not in vs.copies]
            if new:  # a copy we hold no claim on yet: claimed with the next adoption
                vs.copies.update(dict.fromkeys(new))
                vs.claimed = False
        return vs

    def attach(self, seg: AdoptedSegment, holder: IndexHolder) -> None:
        """``seg`` was adopted and its index chunk appended (``holder``)."""
        seg.holder = holder
        for vs in seg.foreign:
            vs.live += 1
            vs.holders += 1

    def free(self, seg: AdoptedSegment) -> None:
        """Retention or deletion freed ``seg``: its index chunk no longer holds our vseg."""
        if seg.holder is None:
            return
        if seg.holder.vs is not None:
            seg.holder.vs.live -= 1
        self.freed.append(seg)

    def settle(self) -> None:
        """Holders whose vseg of ours was released (below the floor) hold no claim any more."""
        if not self.freed:
            return
        keep = []
        for seg in self.freed:
            if seg.holder.vs is not None and not seg.holder.vs.released:
                keep.append(seg)
                continue
            for vs in seg.foreign:
                vs.holders -= 1
        self.freed = keep

    async def claim(self, vsegs) -> None:
        """Claim ``vsegs`` on the backups holding them before an adoption is answered. A live
        backup that fails fails the adoption (the recovery retries); one that no longer holds
        the file is no copy; a vseg left with no copy at all is lost."""
        if all(vs.claimed for vs in vsegs):
            return   # every recovery request without adoptions, and tries already answered
        owner, epoch = self.identity()
        async with self.lock:  # after a release in flight, so a claim is never undone by it
            todo = [vs for vs in vsegs if not vs.claimed]
            if not todo:
                return
            per: dict[int, list[ForeignVseg]] = {}
            for vs in todo:
                for b in vs.copies:
                    per.setdefault(b, []).append(vs)
            held: dict[ForeignVseg, set[int]] = {vs: set() for vs in todo}
            asked: set[ForeignVseg] = set()
            failed: list[KeraError] = []

            async def one(b: int, mine: list[ForeignVseg]) -> None:
                try:
                    addr = self.addr_of(b)
                except Unavailable:
                    return  # not alive: its copy is not counted on
                try:
                    r, _ = await self.pool.call(addr, "claim", {
                        "owner": owner, "epoch": epoch, "claims": [list(vs.key) for vs in mine]},
                        timeout=CLAIM_TIMEOUT)
                    oks = r.get("held")
                    if not isinstance(oks, list) or len(oks) != len(mine):
                        raise ProtocolError(f"claim answered {oks!r} for {len(mine)} vsegs")
                except KeraError as e:
                    failed.append(e)
                    return
                asked.update(mine)
                for vs, ok in zip(mine, oks, strict=True):
                    if ok:
                        held[vs].add(b)

            async with trio.open_nursery() as n:
                for b, mine in per.items():
                    n.start_soon(one, b, mine)
            for e in failed:   # a fenced owner stops; anything else fails this try (retried)
                if isinstance(e, Fenced):
                    raise e
            if failed:
                raise Unavailable(f"claims not recorded on {len(failed)} backups: {failed[0]}")
            for vs, bs in held.items():
                if vs not in asked:  # no backup of it is known alive here yet: try again later
                    raise Unavailable(f"no live backup to claim vseg {vs.id} of vlog {vs.vlog} of "
                                      f"broker {vs.broker} on")
                if not bs:
                    raise DataLoss(f"no backup holds vseg {vs.id} of vlog {vs.vlog} of broker "
                                   f"{vs.broker} any more: its adopted chunks are lost")
                vs.copies = {b: None for b in sorted(bs)}
                vs.claimed = True

    async def release(self) -> None:
        """Release the claims of foreign vsegs no holder of ours needs any more (retried on
        the next pass after a failure; a backup not alive is asked when it is back)."""
        self.settle()
        done = [vs for vs in self.vsegs.values() if vs.holders == 0 and vs.claimed]
        if not done:
            return
        owner, epoch = self.identity()
        async with self.lock:
            per: dict[int, list[ForeignVseg]] = {}
            for vs in done:
                if vs.holders == 0:
                    for b in vs.copies:
                        per.setdefault(b, []).append(vs)
            left: set[ForeignVseg] = set()

            async def one(b: int, mine: list[ForeignVseg]) -> None:
                try:
                    await self.pool.call(self.addr_of(b), "release", {
                        "owner": owner, "epoch": epoch, "claims": [list(vs.key) for vs in mine]},
                        timeout=CLAIM_TIMEOUT)
                except KeraError as e:
                    left.update(mine)
                    log.info("release of %d foreign vsegs on backup %d: %s", len(mine), b, e)

            async with trio.open_nursery() as n:
                for b, mine in per.items():
                    n.start_soon(one, b, mine)
            for vs in done:
                if vs.holders:  # adopted again meanwhile: its next claim is sent again
                    vs.claimed = False
                elif vs not in left:
                    del self.vsegs[vs.key]
                    self.released += 1
