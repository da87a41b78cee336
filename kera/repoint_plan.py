"""Which segments of a dead broker a new owner takes as evicted instead of replaying them.

Pure decisions (no I/O), driven by ``kera.recovery``. Replaying a broker's
whole retained history into memory costs time and bytes proportional to the
history; most of it was evicted on the dead broker anyway. Its settled
prefix (``RecoveryPlan.settled``: closed vsegs held whole by a copy) is
listed by the backups as index rows, never as bodies, and a segment is
*re-pointed* (handed to its new owner as an evicted segment whose index
names those copies) when:

- it is not its group's last segment in the rows (so it took no more chunks:
  a group opens a segment only when the one before has no room), or it is,
  and the rows hold the group's *close chunk* (``chunk.CLOSE``: the broker
  closed the group, no chunk follows in it) naming that segment and its head;
  its index chunk then carries ``INDEX | CLOSE``;
- its chunks start at offset 0 and follow each other without a gap (all of
  them lie before the next segment's first chunk in the group's one vlog,
  so all are in the settled prefix and listed);
- every segment of the group before it is re-pointed too (a prefix: placement
  stays in group order; what follows is replayed as before, and a hole there
  is still ``DataLoss``).

Segments the dead broker had itself adopted are listed as *index chunks*
(``kera.index_chunk``: the adoptions it made durable in its vlog, one per run
of consecutive segments): each is re-pointed as it stands (it names the
original copies) whenever the segments before its run are, last or not.

A group whose first listed segment starts past offset 0 began in released
vsegs: that segment is dropped (retention frees whole segments), as replay
drops it. A settled vseg none of whose chunks is replayed is not read at all;
a close chunk is never adopted and never keeps its vseg replayed by itself.

The rows are one u64 array (a row per chunk, columns below), planned with
array operations: Python loops run per segment or group, never per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .chunk import CLOSE, INDEX
from .index_chunk import MAX_ROWS

# the columns of a row: one chunk of a settled vseg, as a backup's index lists it
VLOG, VSEG, VOFF, SIZE, STREAM, STREAMLET, GROUP, SEGMENT, OFFSET, PRODUCER, SEQUENCE, FLAGS, LAST = range(13)
_32, _40 = np.uint64(32), np.uint64(1 << 40)
COLUMNS = 13        # VOFF..FLAGS are the backup's answer; VLOG, VSEG the vseg it answered for;
# LAST the last segment the row covers: SEGMENT, or an index chunk's run's last (``kera.repoint``)


class Adopted(NamedTuple):
    """A re-pointed segment: its chunks' rows in order, all in settled vsegs of one vlog (or
    one index chunk of the dead broker's own adoption of it, covering ``segment`` up to its
    row's ``LAST``). A plain tuple over the plan's rows: a plan makes one per segment."""

    stream: int
    streamlet: int
    group: int
    segment: int
    table: np.ndarray     # the plan's rows, sorted; this segment's are ``rows``
    at: int               # its first row there
    count: int            # its rows (1 for an index chunk)
    closed: bool = False  # its group's last segment, proved complete by the group's close chunk
    indexed: bool = False  # one index chunk of the dead broker's own
    head: int = 0         # its last chunk's end (a segment of records)

    @property
    def rows(self) -> np.ndarray:
        """(count, COLUMNS) u64: its chunks' rows, in offset order."""
        return self.table[self.at:self.at + self.count]


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

    def ended(self) -> set[tuple[int, int, int]]:
        """The (stream, streamlet, group) whose re-pointed segments reach the group's end: the
        last one proved complete by the group's close chunk, or an index chunk flagged CLOSE.
        The replay sends no chunk of theirs (every one is below ``replay_from``), so their
        adoption may be built beside it; the other groups' adoption comes first."""
        last = {(a.stream, a.streamlet, a.group): a for a in self.adopted}
        return {k for k, a in last.items()
                if a.closed or a.indexed and int(a.rows[0, FLAGS]) & CLOSE}


def plan_repoint(rows: np.ndarray, settled: dict[int, list[int]],
                 replayed: frozenset = frozenset()) -> Repoint:
    """Decide from the index ``rows`` ((n, COLUMNS) u64) of the settled vsegs (``settled``:
    vlog -> vseg ids; rows of streamlets nobody recovers left out by the caller). Streamlets
    in ``replayed`` (stream, streamlet) adopt nothing: their rows only keep their vsegs
    replayed."""
    rows = np.asarray(rows, np.uint64).reshape(-1, COLUMNS)
    close = rows[:, FLAGS] & (INDEX | CLOSE) == CLOSE
    closes: dict[tuple[int, int, int], set[tuple[int, int]]] = {}
    close_rows = rows[close]
    for sid, sl, gid, s, off in close_rows[:, [STREAM, STREAMLET, GROUP, SEGMENT, OFFSET]].tolist():
        closes.setdefault((sid, sl, gid), set()).add((s, off))
    rows = rows[~close]
    index = rows[:, FLAGS] & INDEX != 0
    # sorted by (stream, streamlet), (group, segment), then an index chunk first in its segment
    # (the one covering the longest run first), then offset: three u64 keys, the header's
    # streamlet, group, segment and offset being u32 and stream ids below 2**32 (the caller's)
    assert not (rows[:, STREAM] >> _32).any(), "stream ids below 2**32"
    sl = (rows[:, STREAM] << _32) | rows[:, STREAMLET]
    gs = (rows[:, GROUP] << _32) | rows[:, SEGMENT]
    at = np.where(index, _40 - np.uint64(1) - rows[:, LAST], _40 + rows[:, OFFSET])
    order = np.lexsort((at, gs, sl))
    rows, index, sl, gs = rows[order], index[order], sl[order], gs[order]
    out = Repoint()
    n = len(rows)
    taken = np.zeros(0, bool)
    if n:
        # per segment (a run of rows): first row, count, head, whole from 0, index chunk first
        new = np.ones((n, 2), bool)
        new[1:, 1] = (sl[1:] != sl[:-1]) | (gs[1:] >> _32 != gs[:-1] >> _32)   # a group starts
        new[1:, 0] = new[1:, 1] | (gs[1:] != gs[:-1])                         # a segment starts
        first = np.flatnonzero(new[:, 0])
        count = np.diff(np.append(first, n))
        end = rows[:, OFFSET] + rows[:, SIZE]
        gap = ~new[:, 0]
        gap[1:] &= rows[1:, OFFSET] != end[:-1]
        whole = (rows[first, OFFSET] == 0) & (np.add.reduceat(gap, first) == 0)
        head = end[first + count - 1]
        groups = np.flatnonzero(new[first, 1])
        ends = np.append(groups[1:], len(first))
        seg, last = rows[first, SEGMENT], rows[first, LAST]
        indexed = index[first]
        # per segment: whether it may be re-pointed by itself (an index chunk's run as it stands,
        # or a whole segment of records, not too many chunks, proved complete if its group's
        # last), and whether it follows the one before (an index chunk's run covers up to LAST)
        is_last = np.zeros(len(first), bool)
        is_last[ends - 1] = True
        closed = np.zeros(len(first), bool)
        for k in (ends - 1)[~indexed[ends - 1]].tolist():   # per group: its close chunk names its head
            r = rows[first[k]]
            marks = closes.get((int(r[STREAM]), int(r[STREAMLET]), int(r[GROUP])))
            closed[k] = marks is not None and (int(seg[k]), int(head[k])) in marks
        good = indexed | (whole & (count <= MAX_ROWS) & (~is_last | closed))
        good[1:] &= new[first[1:], 1] | (seg[1:] == np.maximum(last[:-1], seg[:-1]) + np.uint64(1))
        # a group's first segment that began in released vsegs is dropped, the next one first
        dropped = np.zeros(len(first), bool)
        dropped[groups] = rows[first[groups], OFFSET] != 0
        good |= dropped
        stop = np.minimum.reduceat(np.where(good, len(first), np.arange(len(first))), groups)
        stop = np.minimum(stop, ends)                      # each group's first segment not taken
        begin = groups + dropped[groups]
        taken = np.zeros(len(first), bool)
        replayed_groups = [(sid, sl) in replayed for sid, sl in rows[first[groups]][:, [STREAM, STREAMLET]].tolist()]
        for g0, j, k, skip in zip(groups.tolist(), begin.tolist(), stop.tolist(), replayed_groups, strict=True):
            if k <= j or skip:
                continue
            taken[g0:k] = True
            sid, sl, gid = (int(x) for x in rows[first[j], [STREAM, STREAMLET, GROUP]])
            out.replay_from[(sid, sl, gid)] = int(max(last[k - 1], seg[k - 1])) + 1
            at = first[j:k].tolist()
            out.adopted += [
                Adopted(sid, sl, gid, s, rows, i, 1, indexed=True) if x else
                Adopted(sid, sl, gid, s, rows, i, n, c, head=h)
                for i, n, s, x, c, h in zip(at, count[j:k].tolist(), seg[j:k].tolist(), indexed[j:k].tolist(),
                                            closed[j:k].tolist(), head[j:k].tolist(), strict=True)]
    # a settled vseg is skipped when every chunk in it is taken; a close chunk counts only while
    # its segment is replayed (else the new owner would not learn its group closed)
    left = rows[~np.repeat(taken, count if n else 0)]
    kept = [(v, s) for v, s, sid, sl, gid, seg in close_rows[:, [VLOG, VSEG, STREAM, STREAMLET, GROUP,
                                                                 SEGMENT]].tolist()
            if out.replay_from.get((sid, sl, gid), 0) <= seg]
    for vlog, vsegs in settled.items():
        busy = np.sort(left[left[:, VLOG] == vlog, VSEG])
        busy = set(busy[np.append(True, busy[1:] != busy[:-1])].tolist()) if len(busy) else set()
        busy.update(s for v, s in kept if v == vlog)
        for s in vsegs:
            if s not in busy:
                out.skip.setdefault(vlog, set()).add(s)
    return out
