"""Which segments of a dead broker a new owner takes as evicted instead of replaying them.

Pure decisions (no I/O), driven by ``kera.recovery``. Replaying a broker's
whole retained history into memory costs time and bytes proportional to the
history; most of it was evicted on the dead broker anyway. Its settled
prefix (``RecoveryPlan.settled``: closed vsegs held whole by a copy) is
listed by the backups as index rows, never as bodies, and a segment is
*re-pointed* (handed to its new owner as an evicted segment whose index
names those copies) when:

- it is not its group's last segment in the rows (so it took no more chunks:
  a group opens a segment only when the one before has no room);
- its chunks start at offset 0 and follow each other without a gap (all of
  them lie before the next segment's first chunk in the group's one vlog,
  so all are in the settled prefix and listed);
- every segment of the group before it is re-pointed too (a prefix: placement
  stays in group order; what follows is replayed as before, and a hole there
  is still ``DataLoss``).

A segment the dead broker had itself adopted is listed as one *index chunk*
(``kera.index_chunk``: the adoption it made durable in its vlog): it is
re-pointed as it stands (it names the original copies) whenever the
segments before it are, last or not.

A group whose first listed segment starts past offset 0 began in released
vsegs: that segment is dropped (retention frees whole segments), as replay
drops it. A settled vseg none of whose chunks is replayed is not read at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from .chunk import INDEX
from .index_chunk import MAX_ROWS


class Row(NamedTuple):
    """One chunk of a settled vseg, as a backup's index lists it."""

    vlog: int
    vseg: int
    voff: int        # byte offset in the vseg
    size: int
    stream: int
    streamlet: int
    group: int
    segment: int
    offset: int      # byte offset in the segment
    producer: int
    sequence: int
    flags: int = 0

    @property
    def index(self) -> bool:
        """An index chunk: an adopted segment, not records."""
        return bool(self.flags & INDEX)


@dataclass(slots=True)
class Adopted:
    """A re-pointed segment: its chunks in order, all in settled vsegs of one vlog (or one
    index chunk of the dead broker's own adoption of it)."""

    stream: int
    streamlet: int
    group: int
    segment: int
    rows: list[Row]

    @property
    def indexed(self) -> bool:
        return self.rows[0].index

    @property
    def head(self) -> int:
        r = self.rows[-1]
        return r.offset + r.size


@dataclass(slots=True)
class Repoint:
    adopted: list[Adopted] = field(default_factory=list)
    # (stream, streamlet, group) -> first segment replayed: the backups skip chunks below it
    replay_from: dict[tuple[int, int, int], int] = field(default_factory=dict)
    skip: dict[int, set[int]] = field(default_factory=dict)   # vlog -> vsegs not replayed at all

    @property
    def bytes(self) -> int:
        """Chunk bytes re-pointed from the rows (index chunks' segments not counted)."""
        return sum(a.head for a in self.adopted if not a.indexed)


def plan_repoint(rows: Iterable[Row], settled: dict[int, Iterable[int]]) -> Repoint:
    """Decide from the index ``rows`` of the settled vsegs (``settled``: vlog -> vseg ids;
    rows of streamlets nobody recovers left out by the caller)."""
    by_group: dict[tuple[int, int, int], dict[int, list[Row]]] = {}
    per_vseg: dict[tuple[int, int], list[Row]] = {}
    for r in rows:
        by_group.setdefault((r.stream, r.streamlet, r.group), {}).setdefault(r.segment, []).append(r)
        per_vseg.setdefault((r.vlog, r.vseg), []).append(r)
    out = Repoint()
    taken: set[tuple[int, int, int, int]] = set()
    for (sid, sl, gid), segs in by_group.items():
        order = sorted(segs)
        first = order[0]
        start = 1 if segs[first][0].offset != 0 else 0  # began in released vsegs: dropped
        adopted = []
        prev = first if start else first - 1
        for i, s in enumerate(order[start:], start):
            index = [r for r in segs[s] if r.index]
            chunks = index[:1] or sorted(segs[s], key=lambda r: r.offset)
            if s != prev + 1:
                break
            # a segment of records: never the last listed, whole and not too many chunks
            if not index and (i == len(order) - 1 or not _contiguous(chunks) or len(chunks) > MAX_ROWS):
                break
            adopted.append(Adopted(sid, sl, gid, s, chunks))
            prev = s
        if not adopted:
            continue
        out.adopted += adopted
        out.replay_from[(sid, sl, gid)] = adopted[-1].segment + 1
        for a in adopted:
            taken.add((sid, sl, gid, a.segment))
    for vlog, vsegs in settled.items():
        for s in vsegs:
            rs = per_vseg.get((vlog, s), [])
            if all((r.stream, r.streamlet, r.group, r.segment) in taken or
                   r.segment < out.replay_from.get((r.stream, r.streamlet, r.group), -1)
                   for r in rs):
                out.skip.setdefault(vlog, set()).add(s)
    return out


def _contiguous(chunks: list[Row]) -> bool:
    at = 0
    for r in chunks:
        if r.offset != at:
            return False
        at = r.offset + r.size
    return True
