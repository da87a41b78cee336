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

import numpy as np

from .chunk import CLOSE, INDEX
from .index_chunk import MAX_ROWS

# the columns of a row: one chunk of a settled vseg, as a backup's index lists it
VLOG, VSEG, VOFF, SIZE, STREAM, STREAMLET, GROUP, SEGMENT, OFFSET, PRODUCER, SEQUENCE, FLAGS, LAST = range(13)
_32, _40 = np.uint64(32), np.uint64(1 << 40)
COLUMNS = 13        # VOFF..FLAGS are the backup's answer; VLOG, VSEG the vseg it answered for;
# LAST the last segment the row covers: SEGMENT, or an index chunk's run's last (``kera.repoint``)


@dataclass(slots=True)
class Adopted:
    """A re-pointed segment: its chunks' rows in order, all in settled vsegs of one vlog (or
    one index chunk of the dead broker's own adoption of it, covering ``segment`` up to its
    row's ``LAST``)."""

    stream: int
    streamlet: int
    group: int
    segment: int
    rows: np.ndarray      # (n, COLUMNS) u64
    closed: bool = False  # its group's last segment, proved complete by the group's close chunk
    indexed: bool = False  # one index chunk of the dead broker's own
    head: int = 0         # its last chunk's end (a segment of records)


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
        taken = np.zeros(len(first), bool)
        ids = rows[first][:, [STREAM, STREAMLET, GROUP, SEGMENT]].tolist()
        lasts = rows[first, LAST].tolist()
        starts, counts, heads = first.tolist(), count.tolist(), head.tolist()
        whole, indexed = whole.tolist(), index[first].tolist()
        for g0, g1 in zip(groups.tolist(), [*groups[1:].tolist(), len(first)], strict=True):
            sid, sl, gid, s0 = ids[g0]
            if (sid, sl) in replayed:
                continue
            j = g0 + int(rows[starts[g0], OFFSET] != 0)  # began in released vsegs: dropped
            prev = s0 if j > g0 else s0 - 1
            marks = closes.get((sid, sl, gid), ())
            adopted = []
            for k in range(j, g1):
                s, at = ids[k][3], starts[k]
                if s != prev + 1:
                    break
                if indexed[k]:  # a run of the dead broker's own adoptions, as it stands
                    adopted.append(Adopted(sid, sl, gid, s, rows[at:at + 1], indexed=True))
                    prev = max(lasts[k], s)
                    continue
                # a segment of records: whole, not too many chunks, and proved complete
                closed = k == g1 - 1 and (s, heads[k]) in marks
                if (k == g1 - 1 and not closed) or not whole[k] or counts[k] > MAX_ROWS:
                    break
                adopted.append(Adopted(sid, sl, gid, s, rows[at:at + counts[k]], closed, head=heads[k]))
                prev = s
            if adopted:
                out.adopted += adopted
                out.replay_from[(sid, sl, gid)] = prev + 1
                taken[g0:j + len(adopted)] = True
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
