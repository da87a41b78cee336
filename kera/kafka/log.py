"""A partition's dense Kafka offsets: each chunk of a streamlet gets the next ones on append.

Kafka numbers a partition's records 0, 1, 2, ...; kera places chunks at [group, segment,
offset]. ``OffsetLog`` bridges the two per streamlet: when a chunk is appended it takes the
next ``record_count`` offsets, its base written in its header (``kera.chunk.set_kafka_offset``;
a Kafka batch's own base offset field too), so a replay after a failure restores them from
the chunk itself (``replayed``, then ``finish``). The index, one row per chunk in offset
order (base, end, group, segment, offset in it, size), answers where an offset lies
(``find``) with a bisection, the high watermark (every chunk below it durable:
``high_watermark``, a cursor moved once per chunk) and the log start offset (the first chunk
still held after retention: ``log_start``). Per chunk: 32 bytes and O(1) work; nothing per
record. Offsets of chunks compacted away or lost leave gaps, as in Kafka's compacted topics.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import deque

import numpy as np

RECENT = 5      # batches per producer whose offsets a duplicate's answer names (Kafka's 5)


class OffsetLog:
    __slots__ = ("bases", "ends", "groups", "segs", "offs", "sizes", "next", "durable", "first",
                 "unsorted", "unknown", "recent")

    def __init__(self):
        self.bases = array("q")
        self.ends = array("q")
        self.groups = array("I")
        self.segs = array("I")
        self.offs = array("I")
        self.sizes = array("I")
        self.next = 0           # the offset the next record gets (Kafka's log end offset)
        self.durable = 0        # rows below are durable: the high watermark is their end
        self.first = 0          # rows below were freed (retention)
        self.unsorted = False   # replayed out of offset order: ``finish`` sorts
        self.unknown: list = []  # replayed chunks written before offsets were kept
        self.recent: dict = {}  # producer -> deque of (last sequence, base offset)

    def __len__(self) -> int:
        return len(self.bases)

    def _row(self, base: int, count: int, group: int, seg: int, off: int, size: int) -> None:
        self.bases.append(base)
        self.ends.append(base + count)
        self.groups.append(group)
        self.segs.append(seg)
        self.offs.append(off)
        self.sizes.append(size)

    def append(self, count: int, group: int, seg: int, off: int, size: int) -> int:
        """A chunk of ``count`` records just appended at [group, seg, off]: its base offset."""
        base = self.next
        self._row(base, count, group, seg, off, size)
        self.next = base + count
        return base

    def replayed(self, base: int | None, count: int, group: int, seg: int, off: int,
                 size: int) -> None:
        """A chunk placed by a recovery, its base offset from its header (None: a chunk
        written before offsets were kept, numbered by ``finish``)."""
        if base is None:
            self.unknown.append((group, seg, off, count, size))
            return
        if self.bases and base < self.bases[-1]:
            self.unsorted = True
        self._row(base, count, group, seg, off, size)
        self.next = max(self.next, base + count)

    def reach(self, end: int) -> None:
        """Offsets below ``end`` are taken (a history still to be adopted holds them)."""
        self.next = max(self.next, end)

    def adopted(self, group: int, seg) -> None:
        """A segment adopted from a dead broker's backups (``kera.broker.adopted``): per chunk
        (or run of chunks following each other in offsets) its end in the segment
        (``seg.ends``), its Kafka base offset + 1 (0: written before offsets were kept) and
        its records (``seg.kafka``, let go once indexed); ``finish`` puts the rows in offset
        order. Columns in, columns appended: nothing per chunk."""
        (kafka, records), seg.kafka = seg.kafka, None
        self._adopted(group, seg.id, seg.ends, kafka, records)

    def _adopted(self, group: int, seg: int, ends, kafka: np.ndarray, records: np.ndarray) -> None:
        ends = np.asarray(ends, np.int64)
        starts = np.concatenate(([0], ends[:-1]))
        known = kafka > 0
        for off, end, n in zip(starts[~known].tolist(), ends[~known].tolist(),
                               records[~known].tolist(), strict=True):   # old chunks only
            self.unknown.append((group, seg, off, n, end - off))
        if not known.any():
            return
        bases = kafka[known].astype(np.int64) - 1
        tops = bases + records[known].astype(np.int64)
        if self.bases and bases[0] < self.bases[-1]:
            self.unsorted = True
        m = len(bases)
        for a, col in ((self.bases, bases), (self.ends, tops), (self.groups, np.full(m, group)),
                       (self.segs, np.full(m, seg)), (self.offs, starts[known]),
                       (self.sizes, (ends - starts)[known])):
            a.frombytes(col.astype(a.typecode).tobytes())
        self.next = max(self.next, int(tops.max()))

    def finish(self) -> None:
        """A recovery placed every chunk: rows in offset order, unknown ones numbered after."""
        if self.unsorted:
            self.first = 0   # rows adopted may go before the retention cursor: looked at again
            cols = [np.frombuffer(a, a.typecode).copy() for a in
                    (self.bases, self.ends, self.groups, self.segs, self.offs, self.sizes)]
            order = np.argsort(cols[0], kind="stable")
            for a, c in zip((self.bases, self.ends, self.groups, self.segs, self.offs, self.sizes),
                            cols, strict=True):
                del a[:]
                a.frombytes(c[order].tobytes())
            self.unsorted = False
        for group, seg, off, count, size in sorted(self.unknown):
            self.append(count, group, seg, off, size)
        self.unknown = []
        self.durable = min(self.durable, len(self.bases))
        self.first = min(self.first, len(self.bases))

    def find(self, offset: int) -> int:
        """The row of the first chunk holding ``offset`` or, in a gap, the first after it."""
        i = bisect_right(self.bases, offset) - 1
        if i < 0:
            return 0
        return i if self.ends[i] > offset else i + 1

    def high_watermark(self, held) -> int:
        """The end of the durable prefix of rows (``held(group, seg)`` is the segment, or None
        once freed: a freed one was durable)."""
        i, n = self.durable, len(self.bases)
        while i < n:
            seg = held(self.groups[i], self.segs[i])
            if seg is not None and seg.durable < self.offs[i] + self.sizes[i]:
                break
            i += 1
        self.durable = i
        return self.ends[i - 1] if i else (self.bases[0] if n else self.next)

    def log_start(self, held) -> int:
        """The first offset still held (retention frees segments from the front)."""
        i, n = self.first, len(self.bases)
        while i < n and held(self.groups[i], self.segs[i]) is None:
            i += 1
        self.first = i
        return self.bases[i] if i < n else self.next

    def row(self, i: int) -> tuple[int, int, int, int, int, int]:
        return (self.bases[i], self.ends[i], self.groups[i], self.segs[i], self.offs[i],
                self.sizes[i])

    def by_time(self, ts_of, ts: int, held) -> int:
        """The first offset whose chunk's newest record is at or after ``ts`` (ms), the log
        end if none: a bisection over chunks by ``ts_of(row)`` (their newest timestamp),
        which producers make rise per partition as Kafka assumes."""
        lo, hi = self.first, len(self.bases)
        while lo < hi:
            mid = (lo + hi) // 2
            t = ts_of(mid)
            if t is None or t < ts:
                lo = mid + 1
            else:
                hi = mid
        return self.bases[lo] if lo < len(self.bases) else self.next

    def remember(self, producer: int, last_seq: int, base: int) -> None:
        """A producer's batch just appended: a resend of it is answered with ``base``."""
        d = self.recent.get(producer)
        if d is None:
            d = self.recent[producer] = deque(maxlen=RECENT)
        d.append((last_seq, base))

    def duplicate_base(self, producer: int, last_seq: int) -> int:
        """The base offset a duplicate batch was given, -1 if no longer known."""
        for s, b in self.recent.get(producer, ()):
            if s == last_seq:
                return b
        return -1
