"""Taking over a dead broker's streamlets: the RPCs a recovery drives on the new owner.

A recovering streamlet is rebuilt from its backups' copies: ``recover`` places the chunks
a backup replays (at the positions their headers carry) and ``adopt`` re-points settled
segments the dead broker held as evicted segments read from their existing vsegs. Both
answer once what they placed is durable in this broker's own virtual logs. Kept apart
from the produce and pull paths, which never see a recovering streamlet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np
import trio

from .. import chunk, limits
from ..errors import InvalidArgument, KeraError, NotOwner, ProtocolError
from ..recovery import index_chunk
from ..rpc import unwrapped
from ..stream_meta import StreamMeta
from . import retention
from .adopted import AdoptedSegment, Claims, IndexHolder, adopted_segments
from .group_close import mark
from .replicator import Replicator
from .segment import VlogChunk
from .streamlet import Streamlet

log = logging.getLogger("kera.broker")


class Guard(Protocol):
    """The membership's checks (``kera.broker.membership``): the request's epoch is ours, our
    lease is live."""

    broker_id: int | None

    def check_epoch(self, meta) -> None: ...
    def check_lease(self) -> None: ...


class Takeover:
    """The broker's side of a recovery: it owns the adoptions made here and not yet settled
    (``unsettled``). Handed what the broker holds (``streams``, ``streamlets``), the
    membership's checks (``guard``), its virtual logs' ways in (``vlog_for``: a group's vlog;
    ``append_close``: a group's close chunk in it; ``durable``: wait until indexes are
    durable), the freeing of segments (``free``, the reclaimer's) and, as they are made for
    each incarnation, the claims on adopted segments' vsegs (``claims``)."""

    def __init__(self, streams: dict[int, StreamMeta], streamlets: dict[tuple[int, int], Streamlet],
                 guard: Guard, *, vlog_for: Callable, append_close: Callable,
                 durable: Callable[[dict], Awaitable[None]], free: Callable[[list], None],
                 claims: Callable[[], Claims]):
        self.streams, self.streamlets, self.guard = streams, streamlets, guard
        self.vlog_for, self.append_close, self.durable, self.free = vlog_for, append_close, durable, free
        self.claims = claims
        self.unsettled: dict[Replicator, int] = {}   # vlog -> its last adoption not yet settled

    async def recover(self, meta, payload):
        """Chunks replayed by a backup: placed where their headers say, then replicated
        through our own virtual logs; answered once they are durable here. An index chunk
        (segments the dead broker had adopted) is adopted again (``_adopt_index``)."""
        self.guard.check_epoch(meta)
        self.guard.check_lease()
        waits: dict[Replicator, int] = {}
        claim: dict = {}
        placed = dup = 0
        for i, (h, off) in enumerate(chunk.scan(payload)):
            sl = self.streamlets.get((h.stream_id, h.streamlet))
            if sl is None or not sl.recovering:
                raise NotOwner(f"stream {h.stream_id} streamlet {h.streamlet} is not being recovered here")
            mv = payload[off:off + h.size]
            try:
                if h.flags & chunk.INDEX:
                    ix = index_chunk.parse(mv, h)
                    done = self._adopt_index(sl, h, mv, ix)
                    if done is None:
                        dup += 1
                        continue
                    vlog, idx, segs = done
                    sl.note_adopted(ix.producers())
                    for seg in segs:
                        claim.update(dict.fromkeys(seg.foreign))
                    waits[vlog] = idx
                    placed += 1
                    continue
                if h.flags & chunk.CLOSE:  # the group was closed: nothing is placed
                    if h.record_count != 1 or h.sequence != 0 or h.size > chunk.HEADER_SIZE + 64:
                        raise InvalidArgument(f"stream {h.stream_id} streamlet {h.streamlet}: a chunk "
                                              f"flagged CLOSE that is not a group's close chunk")
                    g = mark(sl, h.group)
                    if g is not None:  # recorded again in our vlog, after the group's chunks
                        vlog, idx = self.append_close(sl, g, VlogChunk(bytes(mv)), h.body_checksum)
                        waits[vlog] = idx
                    dup += 1
                    continue
                g, seg = sl.place(mv, h.producer_id, h.group, h.segment, h.offset)
            except KeraError as e:  # DataLoss: a hole before it; refused, never stored past it
                e.index = i  # which chunk of the request: the backup knows its offset
                log.error("recovery: %s; chunk refused", e)
                raise
            if seg is None:
                dup += 1
                continue
            vlog = self.vlog_for(self.streams[h.stream_id], h.streamlet, g)
            idx = vlog.append(seg, h.offset, h.size, h.body_checksum)
            sl.note_producer(h.producer_id, h.sequence, vlog, idx)
            waits[vlog] = idx
            placed += 1
        return await self._claimed_and_durable(claim, waits, {"placed": placed, "duplicates": dup})

    async def adopt(self, meta, payload):
        """Recovery re-points a dead broker's settled segments here as evicted segments: the
        payload holds one index chunk per run of a group's segments (``kera.recovery.index_chunk``), in
        group order. Answered once they are built and their index chunks appended to our own
        vlogs (each vlog's open vseg closed behind them: what is placed later goes to another
        vseg, released apart from the adoptions), so the replay of what follows them in their
        groups can start; ``settle`` answers once they are durable and claimed."""
        self.guard.check_epoch(meta)
        self.guard.check_lease()
        todo = []
        for h, off in chunk.scan(payload):  # all checked before anything changes
            sl = self.streamlets.get((h.stream_id, h.streamlet))
            if sl is None or not (sl.recovering or sl.is_pending(h.group)):
                raise NotOwner(f"stream {h.stream_id} streamlet {h.streamlet} group {h.group} is not "
                               f"being recovered here")
            try:
                mv = payload[off:off + h.size]
                todo.append((sl, h, mv, index_chunk.parse(mv, h)))
            except ProtocolError as e:
                raise InvalidArgument(f"adopt takes index chunks: {e}") from None
        vlogs: dict[Replicator, None] = {}
        adopted = 0
        rows: dict[Streamlet, list] = {}
        try:
            for sl, h, mv, ix in todo:
                await trio.lowlevel.checkpoint()   # others are served between runs
                if self.streamlets.get((h.stream_id, h.streamlet)) is not sl or not (
                        sl.recovering or sl.is_pending(h.group)):
                    raise NotOwner(f"stream {h.stream_id} streamlet {h.streamlet} is no longer "
                                   f"being recovered here")  # unassigned meanwhile
                done = self._adopt_index(sl, h, mv, ix)
                if done is not None:
                    vlog, idx, segs = done
                    vlogs[vlog] = None
                    self.unsettled[vlog] = max(idx, self.unsettled.get(vlog, 0))
                    for seg in segs:
                        self.claims().pending.update(dict.fromkeys(seg.foreign))
                    rows.setdefault(sl, []).append(ix.rows)
                    adopted += len(segs)
        finally:  # one pass per streamlet over every adopted segment's rows
            for sl, rs in rows.items():
                sl.note_adopted(index_chunk.highest_sequences(np.concatenate(rs)))
            for v in vlogs:
                if v.log.close_open(durable=False):
                    v.poke()
        return {"adopted": adopted}

    def pend(self, meta, payload):
        """A recovery hands streamlets over before the closed groups of the dead broker's
        history are adopted (``kera.recovery.adoption``): ``entries`` [[stream_id, streamlet, [[lo,
        hi], ...] group id ranges, [[producer, highest sequence], ...], [[slot, newest group],
        ...], optionally the end of their Kafka offsets], ...] of ``source``
        [broker, epoch] wait here until adopted (no range: adopted, served). Every streamlet
        named must be ours and every field well formed; nothing changes otherwise."""
        self.guard.check_epoch(meta)
        src = tuple(meta["source"])
        todo = [(self.streamlets.get((sid, i)), sid, i, [tuple(r) for r in rs], dict(map(tuple, highest)),
                 dict(map(tuple, tops)), *knext) for sid, i, rs, highest, tops, *knext in meta["entries"]]
        for _, _, _, rs, *_ in todo:
            if not all(lo <= hi < 1 << 32 for lo, hi in rs) or \
                    sum(hi - lo + 1 for lo, hi in rs) > limits.MAX_PENDING_GROUPS:
                raise InvalidArgument(f"pend: group id ranges [lo, hi] with lo <= hi < 2**32, at most "
                                      f"{limits.MAX_PENDING_GROUPS} group ids per streamlet")
        for sl, sid, i, *_ in todo:
            if sl is None:
                raise NotOwner(f"stream {sid} streamlet {i} is not on broker {self.guard.broker_id}")
        for sl, _, _, ranges, highest, tops, *knext in todo:
            if ranges:
                sl.pend(src, ranges, highest, tops, *knext)
            elif src in sl.pending:
                sl.unpend(src)
                if not sl.pending and not sl.recovering:
                    # what the dead broker had freed already and came back with the adoption goes
                    # before a reader sees it, as at a hand-over (``BrokerService._assign``)
                    self.free(retention.expired(sl, time.time(), settled_only=False))
        return {}

    async def settle(self, meta, payload):
        """Answered once every adoption made here so far is durable in our vlogs and every
        foreign vseg it reads is claimed on its backups (a claim is an fsync on each backup):
        a recovery asks while it replays the rest and hands over only after the answer, so
        neither a failure of ours nor the backups' letting go of the dead incarnation loses
        an adopted segment once it serves."""
        self.guard.check_epoch(meta)
        self.guard.check_lease()
        pending = self.claims().pending
        for vs in [vs for vs in pending if vs.live <= 0]:
            del pending[vs]   # no segment of ours reads it any more (a failed recovery's, unassigned)
        waits, claim = dict(self.unsettled), dict(pending)
        await self._claimed_and_durable(claim, waits, {})
        for v, idx in waits.items():
            if self.unsettled.get(v) == idx:
                del self.unsettled[v]
        for vs in claim:
            if vs.claimed:
                self.claims().pending.pop(vs, None)
        return {}

    async def _claimed_and_durable(self, claim: dict, waits: dict, reply: dict) -> dict:
        """``reply`` once the foreign vsegs are claimed and what was placed is durable: the two
        at once (each an fsync away)."""
        async with unwrapped(), trio.open_nursery() as n:  # a failure cancels the other, typed
            n.start_soon(self.claims().claim, claim)
            n.start_soon(self.durable, waits)
        return reply

    def _adopt_index(self, sl: Streamlet, h, data, ix):
        """Adopt the segments of the run ``ix`` describes that the group does not hold yet,
        and append its index chunk (``data``, header ``h``) to the group's own vlog:
        (vlog, ref, the run's adopted segments), None if the group holds one of them other
        than as adopted (placed by replay)."""
        g = sl.groups.get(h.group)
        held = 0 if g is None else min(max(len(g.segments) - h.segment, 0), len(ix.counts))
        segs = g.segments[h.segment:h.segment + held] if held else []
        if not all(isinstance(seg, AdoptedSegment) for seg in segs):
            return None
        if held == len(ix.counts):
            if h.flags & chunk.CLOSE:
                mark(sl, h.group)
            # adopted by an earlier try whose answer was lost or which failed later: claimed
            # again, and answered once what that try appended is durable
            vlog = self.vlog_for(self.streams[h.stream_id], h.streamlet, g)
            return vlog, vlog.log.appended, segs
        new = adopted_segments(ix, sl.segment_size, self.claims())[held:]
        for seg in new:
            sl.adopt(h.group, h.producer_id, seg)   # DataLoss past a hole (only the first can be)
        if h.flags & chunk.CLOSE:  # the group's last segment: nothing is appended after it
            mark(sl, h.group)
        holder = IndexHolder(bytes(data), len(new))
        vlog = self.vlog_for(self.streams[h.stream_id], h.streamlet, sl.groups[h.group])
        idx = vlog.append(holder, 0, holder.head, h.body_checksum)
        for seg in new:
            self.claims().attach(seg, holder)
        return vlog, idx, segs + new
