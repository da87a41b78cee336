"""Which segments of a dead broker a new owner takes as evicted instead of replaying them.

Pure decisions (no I/O), driven by ``kera.recovery.manager``. Replaying a broker's
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
(``kera.recovery.index_chunk``: the adoptions it made durable in its vlog, one per run
of consecutive segments): each is re-pointed as it stands (it names the
original copies) whenever the segments before its run are, last or not.

A group whose first listed segment starts past offset 0 began in released
vsegs: that segment is dropped (retention frees whole segments), as replay
drops it. A settled vseg none of whose chunks is replayed is not read at all;
a close chunk is never adopted and never keeps its vseg replayed by itself.

The rows are one u64 array (a row per chunk, or per run of a producer's
consecutive chunks in a segment and a vseg: the plan is the same, and a
recovery plans from runs, a row per few hundred KiB of history rather than
per chunk), planned with array operations: Python loops run per segment or
group, never per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..chunk import CLOSE, INDEX
from ..wire import columns
from .index_chunk import MAX_ROWS

# the columns of a row: one chunk of a settled vseg as a backup's index lists it, or a run of
# chunks (``kera.backup.replica.index_runs``: one producer's, following each other in one
# segment, one vseg and its partition's offsets, SIZE their bytes, SEQUENCE the highest,
# RECORDS their records, COUNT how many); KAFKA: the first one's Kafka base offset + 1 (0: none)
(VLOG, VSEG, VOFF, SIZE, STREAM, STREAMLET, GROUP, SEGMENT, OFFSET, PRODUCER, SEQUENCE, FLAGS, KAFKA,
 RECORDS, LAST, COUNT) = range(16)
_32, _40 = np.uint64(32), np.uint64(1 << 40)
COLUMNS = 16        # VOFF..RECORDS are the backup's answer (and COUNT, of runs); VLOG, VSEG the
# vseg it answered for; LAST the last segment the row covers: SEGMENT, or an index chunk's run's
# last (``kera.recovery.repoint``)
# VOFF..RECORDS are an index row as the wire lays it out (``kera.wire.columns``): each is the
# wire's IX_ column of its name, VOFF on
assert (VOFF, SIZE, STREAM, STREAMLET, GROUP, SEGMENT, OFFSET, PRODUCER, SEQUENCE, FLAGS, KAFKA,
        RECORDS) == tuple(VOFF + getattr(columns, "IX_" + name) for name in (
            "VOFF", "SIZE", "STREAM", "STREAMLET", "GROUP", "SEGMENT", "OFFSET", "PRODUCER",
            "SEQUENCE", "FLAGS", "KAFKA", "RECORDS")) and RECORDS + 1 - VOFF == columns.INDEX_COLUMNS, \
    "the planner's rows carry an index row whole, in the wire's order"


def answer_rows(a: np.ndarray, vlog, vseg, runs: bool) -> np.ndarray:
    """A backup's index answer (per row VOFF..RECORDS, then the count if ``runs``) for ``vlog``
    and ``vseg`` (each a number, or an array of one per row) as rows of the plan."""
    out = np.empty((len(a), COLUMNS), np.uint64)
    out[:, VLOG], out[:, VSEG] = vlog, vseg
    out[:, VOFF:RECORDS + 1] = a[:, :columns.INDEX_COLUMNS]
    out[:, LAST] = out[:, SEGMENT]
    out[:, COUNT] = a[:, columns.IX_COUNT] if runs else 1
    return out


@dataclass(slots=True)
class Adopted:
    """A re-pointed segment: its rows in order (a row per chunk, or per run of chunks), all in
    settled vsegs of one vlog (or one index chunk of the dead broker's own adoption of it,
    covering ``segment`` up to its row's ``LAST``)."""

    stream: int
    streamlet: int
    group: int
    segment: int
    rows: np.ndarray      # (n, COLUMNS) u64
    closed: bool = False  # its group's last segment, proved complete by the group's close chunk
    indexed: bool = False  # one index chunk of the dead broker's own
    head: int = 0         # its last chunk's end (a segment of records)
    chunks: int = 1       # chunks its rows stand for (a row may be a run of them)


class Repoint:
    """The plan: per group the segments re-pointed (a *span* of the sorted segments, made into
    ``Adopted`` only when asked: a recovery asks for the groups the replay continues, not
    for the closed history it adopts after the hand-over), where the replay starts, and the
    vsegs not replayed at all."""

    def __init__(self) -> None:
        # (stream, streamlet, group) -> first segment replayed: the backups skip chunks below it
        self.replay_from: dict[tuple[int, int, int], int] = {}
        self.skip: dict[int, set[int]] = {}   # vlog -> vsegs not replayed at all
        self.spans: list[tuple[int, int, int, int, int]] = []   # (stream, streamlet, group, k0, k1)
        self.rows = np.zeros((0, COLUMNS), np.uint64)   # sorted: per segment k, rows from starts[k]
        self.starts: list[int] = []
        self.counts: list[int] = []      # rows of segment k
        self.segment: list[int] = []
        self.heads: list[int] = []
        self.chunks: list[int] = []
        self.indexed: list[bool] = []
        self.closed: set[int] = set()    # segments k proved complete by their group's close chunk
        self._adopted: list[Adopted] | None = None

    def span(self, i: int) -> list[Adopted]:
        """The re-pointed segments of span ``i``, in order (new objects at each call)."""
        sid, sl, gid, k0, k1 = self.spans[i]
        out = []
        for k in range(k0, k1):
            at = self.starts[k]
            if self.indexed[k]:
                out.append(Adopted(sid, sl, gid, self.segment[k], self.rows[at:at + 1], indexed=True))
            else:
                out.append(Adopted(sid, sl, gid, self.segment[k], self.rows[at:at + self.counts[k]],
                                   k in self.closed, head=self.heads[k], chunks=self.chunks[k]))
        return out

    def records(self, i: int) -> np.ndarray | None:
        """The rows of span ``i``'s segments, one after the other, if it holds no index chunk of
        the dead broker's own (else None: see ``span``)."""
        _, _, _, k0, k1 = self.spans[i]
        if any(self.indexed[k0:k1]):
            return None
        return self.rows[self.starts[k0]:self.starts[k1 - 1] + self.counts[k1 - 1]]

    @property
    def adopted(self) -> list[Adopted]:
        """Every re-pointed segment, in (stream, streamlet, group, segment) order."""
        if self._adopted is None:
            self._adopted = [a for i in range(len(self.spans)) for a in self.span(i)]
        return self._adopted

    @property
    def segments(self) -> int:
        return sum(k1 - k0 for *_, k0, k1 in self.spans)

    @property
    def bytes(self) -> int:
        """Chunk bytes re-pointed from the rows (index chunks' segments not counted)."""
        return sum(self.heads[k] for *_, k0, k1 in self.spans for k in range(k0, k1) if not self.indexed[k])

    def ends(self, i: int) -> bool:
        """Span ``i`` reaches its group's end: its last segment proved complete by the group's
        close chunk, or an index chunk flagged CLOSE."""
        k = self.spans[i][4] - 1
        return k in self.closed or self.indexed[k] and bool(int(self.rows[self.starts[k], FLAGS]) & CLOSE)

    def ended(self) -> set[tuple[int, int, int]]:
        """The (stream, streamlet, group) whose re-pointed segments reach the group's end.
        The replay sends no chunk of theirs (every one is below ``replay_from``), so their
        adoption may be built beside it or after the hand-over; the others' adoption comes first."""
        return {sp[:3] for i, sp in enumerate(self.spans) if self.ends(i)}


def plan_repoint(rows: np.ndarray, settled: dict[int, list[int]],
                 replayed: frozenset = frozenset()) -> Repoint:
    """Decide from the index ``rows`` ((n, COLUMNS) u64) of the settled vsegs (``settled``:
    vlog -> vseg ids; rows of streamlets nobody recovers left out by the caller). Streamlets
    in ``replayed`` (stream, streamlet) adopt nothing: their rows only keep their vsegs
    replayed."""
    rows = np.asarray(rows, np.uint64).reshape(-1, COLUMNS)
    close = rows[:, FLAGS] & (INDEX | CLOSE) == CLOSE
    close_rows = rows[close]
    out = Repoint()
    rows, index, sl, gs = _ordered(rows, close)
    taken, count = np.zeros(0, bool), 0
    if len(rows):
        taken, count = _spans(out, rows, index, sl, gs, _closes(close_rows), replayed)
    _skips(out, rows, taken, count, close_rows, settled)
    return out


def _closes(close_rows: np.ndarray) -> dict[tuple[int, int, int], set[tuple[int, int]]]:
    """(stream, streamlet, group) -> the (segment, offset) of each of its close chunks."""
    closes: dict[tuple[int, int, int], set[tuple[int, int]]] = {}
    for sid, sl, gid, s, off in close_rows[:, [STREAM, STREAMLET, GROUP, SEGMENT, OFFSET]].tolist():
        closes.setdefault((sid, sl, gid), set()).add((s, off))
    return closes


def _ordered(rows: np.ndarray, close: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows but the ``close`` chunks', sorted by (stream, streamlet), (group, segment),
    then an index chunk first in its segment (the one covering the longest run first), then
    offset; with which are index chunks, and the first two sort keys."""
    index = rows[:, FLAGS] & INDEX != 0
    # three u64 keys, the header's streamlet, group, segment and offset being u32 and stream
    # ids below 2**32 (the caller's)
    assert not (rows[:, STREAM] >> _32).any(), "stream ids below 2**32"
    sl = (rows[:, STREAM] << _32) | rows[:, STREAMLET]
    gs = (rows[:, GROUP] << _32) | rows[:, SEGMENT]
    at = np.where(index, _40 - np.uint64(1) - rows[:, LAST], _40 + rows[:, OFFSET])
    order = np.lexsort((at, gs, sl))
    order = order[~close[order]]   # close chunks apart (one gather of the rows, not two)
    return rows[order], index[order], sl[order], gs[order]


def _spans(out: Repoint, rows, index, sl, gs, closes: dict, replayed) -> tuple[np.ndarray, np.ndarray]:
    """Each group's re-pointed span of segments into ``out`` (its rows per segment, the
    segments' heads, chunks, where each group's replay starts); returns which segments are
    taken, and each one's count of rows."""
    n = len(rows)
    # per segment (a run of rows): first row, count, head, whole from 0, index chunk first
    new = np.ones((n, 2), bool)
    new[1:, 1] = (sl[1:] != sl[:-1]) | (gs[1:] >> _32 != gs[:-1] >> _32)   # a group starts
    new[1:, 0] = new[1:, 1] | (gs[1:] != gs[:-1])                         # a segment starts
    first = np.flatnonzero(new[:, 0])
    m = len(first)
    count = np.diff(np.append(first, n))        # rows per segment
    chunks = np.add.reduceat(rows[:, COUNT], first)   # chunks per segment
    end = rows[:, OFFSET] + rows[:, SIZE]
    gap = ~new[:, 0]
    gap[1:] &= rows[1:, OFFSET] != end[:-1]
    whole = (rows[first, OFFSET] == 0) & (np.add.reduceat(gap, first) == 0)
    head = end[first + count - 1]
    g0s = np.flatnonzero(new[first, 1])             # each group's first segment
    g1s = np.append(g0s[1:], m)
    seg = rows[first, SEGMENT].astype(np.int64)
    indexed = index[first]
    # a run of the dead broker's own adoptions reaches its run's last segment
    reach = np.where(indexed, np.maximum(rows[first, LAST].astype(np.int64), seg), seg)
    # the segment each must follow: the one before it, or (a group's first) none, or when the
    # group began in released vsegs (its first segment does not start at 0: dropped) that one
    dropped = rows[first[g0s], OFFSET] != 0
    js = g0s + dropped
    prev = np.empty(m, np.int64)
    prev[1:] = reach[:-1]
    prev[g0s] = seg[g0s] - 1
    follow = js[dropped & (js < g1s)]
    prev[follow] = seg[follow - 1]
    last = np.zeros(m, bool)
    last[g1s - 1] = True
    # a segment of records is whole, not too many chunks, and proved complete if last
    closed = np.zeros(m, bool)
    keys = rows[first[g0s]][:, [STREAM, STREAMLET, GROUP]].tolist()
    gid_of = {tuple(k): i for i, k in enumerate(keys)} if closes else {}
    for key, marks in closes.items():
        i = gid_of.get(key)
        if i is not None:
            k = int(g1s[i]) - 1
            closed[k] = (int(seg[k]), int(head[k])) in marks
    ok = (seg == prev + 1) & (indexed | ((~last | closed) & whole & (chunks <= MAX_ROWS)))
    bad = np.flatnonzero(~ok)
    es = bad[np.minimum(np.searchsorted(bad, js), len(bad) - 1)] if len(bad) else np.full(len(js), m)
    es = np.where((es >= js) & (es < g1s), es, g1s)   # each group's first segment not re-pointed
    taken = np.zeros(m, bool)
    out.rows, out.starts, out.counts, out.segment = rows, first.tolist(), count.tolist(), seg.tolist()
    out.heads, out.chunks, out.indexed = head.tolist(), chunks.tolist(), indexed.tolist()
    reached = reach.tolist()
    for (sid, sl_, gid), g0, j, e in zip(keys, g0s.tolist(), js.tolist(), es.tolist(), strict=True):
        if e <= j or (sid, sl_) in replayed:
            continue
        out.spans.append((sid, sl_, gid, j, e))
        out.replay_from[(sid, sl_, gid)] = reached[e - 1] + 1
        taken[g0:e] = True
    out.closed = set(np.flatnonzero(closed & ~indexed).tolist())
    return taken, count


def _skips(out: Repoint, rows, taken, count, close_rows, settled: dict) -> None:
    """A settled vseg is skipped when every chunk in it is taken; a close chunk counts only
    while its segment is replayed (else the new owner would not learn its group closed)."""
    left = ~np.repeat(taken, count if len(rows) else 0)
    left_vlog, left_vseg = rows[left, VLOG], rows[left, VSEG]
    kept = [(v, s) for v, s, sid, sl, gid, seg in close_rows[:, [VLOG, VSEG, STREAM, STREAMLET, GROUP,
                                                                 SEGMENT]].tolist()
            if out.replay_from.get((sid, sl, gid), 0) <= seg]
    for vlog, vsegs in settled.items():
        busy = np.sort(left_vseg[left_vlog == vlog])
        busy = set(busy[np.append(True, busy[1:] != busy[:-1])].tolist()) if len(busy) else set()
        busy.update(s for v, s in kept if v == vlog)
        for s in vsegs:
            if s not in busy:
                out.skip.setdefault(vlog, set()).add(s)
