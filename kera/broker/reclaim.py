"""Reclaiming: retention, release of unreferenced vsegs, eviction to the memory budget.

A background pass (``once``) applies retention (whole segments freed),
releases the vsegs nothing live references (their backups delete the files) and
evicts replicated segments down to the memory budget's low-water mark (closing
the open vsegs that keep the oldest filled ones from settling); claims on
foreign vsegs (adopted segments) are released by a loop of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from ..stream_meta import StreamMeta
from . import retention
from .adopted import AdoptedSegment, Claims
from .ledger import Ledger
from .memory import MemoryBudget
from .segment import close_waiting
from .streamlet import Streamlet
from .tiered import TieredReader

RECLAIM_INTERVAL = 0.25


class Reclaim:
    """The broker's freeing of segments and its reclaim loops: it owns the counts of what it
    freed. Handed what the broker holds (``streams``, ``streamlets``, the ``ledger`` of those
    under retention, the ``memory`` budget), its virtual logs (``vlogs``: their floors move,
    their open vsegs close) and, as they are made for each run, the reader of evicted
    segments (``tiered``) and the claims on adopted segments' vsegs (``claims``)."""

    def __init__(self, streams: dict[int, StreamMeta], streamlets: dict[tuple[int, int], Streamlet],
                 ledger: Ledger, memory: MemoryBudget, vlogs: dict, *,
                 tiered: Callable[[], TieredReader | None], claims: Callable[[], Claims]):
        self.streams, self.streamlets, self.ledger, self.memory = streams, streamlets, ledger, memory
        self.vlogs, self.tiered, self.claims = vlogs, tiered, claims
        self.freed_segments = 0    # by retention or deletion
        self.freed_bytes = 0

    def free(self, segments) -> None:
        """Segments gone for good: their memory, their share of their vsegs' lives."""
        for seg in segments:
            if seg.freed and seg.buf is None and seg.capacity == 0:
                continue  # a placeholder (recovery) never held anything
            settled = seg.replicated()
            self.memory.free(seg)
            if self.tiered() is not None:
                self.tiered().forget(seg)
            if isinstance(seg, AdoptedSegment):
                self.claims().free(seg)
            for vs in seg.vsegs:
                vs.live -= 1
                if settled:
                    vs.frozen = True
            self.freed_segments += 1
            self.freed_bytes += seg.head
            seg.freed = True
            if settled:  # else its vsegs still send from it; they drop it when released
                seg.drop_buffer()
            seg.vsegs, seg.ends = [], []

    def once(self) -> None:
        """One pass: retention frees whole expired segments, vsegs nothing live references are
        released (their backups are told), memory is brought down to the low-water mark (the
        vlogs whose open vseg the budget closed are poked, so the close reaches the copies)."""
        now = time.time()
        expiring = self.ledger.expiring
        for sl in list(expiring):   # under retention with filled segments, not every streamlet
            if not sl.filled or (sl.retention_bytes < 0 and sl.retention_ms < 0):
                del expiring[sl]    # back when a segment of it fills (or retention is set)
                continue
            if sl.recovering or sl.pending:
                continue
            freed = retention.expired(sl, now)
            if freed:
                self.free(freed)
            if sl.waiting is not None and close_waiting(sl.waiting):
                sl.waiting.vlog.poke()
        for v in self.vlogs.values():
            if v.log.advance_floor() or v.log.floor > v.trimmed:
                v.poke()
        for v in self.memory.relieve():
            v.poke()

    async def reclaimer(self) -> None:
        while True:
            await trio.sleep(RECLAIM_INTERVAL)
            self.once()

    async def releaser(self) -> None:
        """Claims on foreign vsegs nothing of ours needs any more go (apart from the reclaim
        pass, so a slow backup never delays retention or eviction)."""
        while True:
            await trio.sleep(RECLAIM_INTERVAL)
            await self.claims().release()

    def retention_stats(self) -> dict:
        """Per stream here: retained chunk bytes, evicted bytes, and where each streamlet
        starts (lowest group held, its first segment); with the stream's name and retention,
        so a status needs no listing of every stream."""
        out: dict = {}
        for (sid, i), sl in self.streamlets.items():
            gid, seg, held = sl.start_position()
            evicted = sum(s.head for g in sl.groups.values() for s in g.segments[g.start:] if s.evicted)
            e = out.get(sid)
            if e is None:
                s = self.streams.get(sid)
                e = out[sid] = {"name": s and s.name, "retention_bytes": s.retention_bytes if s else -1,
                                "retention_ms": s.retention_ms if s else -1,
                                "retained": 0, "evicted": 0, "freed": 0, "starts": {}}
            e["retained"] += held
            e["evicted"] += evicted
            e["freed"] += sl.freed_bytes
            e["starts"][i] = [gid, seg]
        return out
