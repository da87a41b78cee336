"""Segments taken over from a dead broker as evicted: their chunks stay on its backups.

A recovery may hand a new owner the dead broker's settled history as index
rows instead of chunk bodies (``kera.repoint_plan``). Such a segment is built
evicted (no buffer): per chunk its end, the dead incarnation's vseg holding
it and its offset there. Its vsegs are *foreign*: named by (dead broker,
vlog, vseg), with the backups that listed a whole closed copy; never written
again, never re-replicated (frozen), and not part of any vlog of ours, so our
floors and trims never touch them. Reads go through ``kera.broker.tiered``
like any evicted segment, verified the same way.
"""

from __future__ import annotations

from array import array

from .segment import Segment


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

    def close_open(self) -> bool:
        return False


class ForeignVseg:
    """A closed vseg of a dead incarnation, read by (broker, vlog, id) from ``copies``."""

    __slots__ = ("id", "broker", "vlog", "copies", "live", "frozen", "closed")

    def __init__(self, broker: int, vlog: int, id: int, copies):
        self.broker, self.vlog, self.id = broker, vlog, id
        self.copies = {int(b): None for b in copies}
        self.live = 0
        self.frozen = True
        self.closed = True


def adopted_segment(id: int, capacity: int, ends, vseg_ids, vseg_offs, vlog: ForeignVlog,
                    vsegs: dict) -> Segment:
    """An evicted segment from its index rows; ``vsegs``: this owner's ForeignVseg by
    (broker, vlog, vseg), shared between the segments that point into one."""
    seg = Segment.gone(id)
    seg.capacity = capacity
    seg.freed = False
    seg.evicted = True
    seg.ends = list(ends)
    seg.head = seg.durable = seg.ends[-1]
    seg.vseg_ids, seg.vseg_offs = array("Q", vseg_ids), array("Q", vseg_offs)
    seg.vlog = vlog
    for vid in dict.fromkeys(vseg_ids):
        vs = vsegs[(vlog.broker, vlog.id, vid)]
        vs.live += 1
        seg.vsegs.append(vs)
    return seg
