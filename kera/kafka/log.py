"""A partition's dense Kafka offsets: each chunk of a streamlet gets the next ones on append.

Kafka numbers a partition's records 0, 1, 2, ...; kera places chunks at [group, segment,
offset]. ``OffsetLog`` bridges the two per streamlet: when a chunk is appended it takes the
next ``record_count`` offsets, its base written in its header (``kera.chunk.set_kafka_offset``;
a Kafka batch's own base offset field too), so a replay after a failure restores them from
the chunk itself (``replayed``, then ``finish``). The index, one row per chunk in offset
order (base, end, group, segment, offset in it, size), answers where an offset lies
(``find``) with a bisection, the high watermark (every chunk below it durable:
``high_watermark``, a cursor moved once per chunk) and the log start offset (the first chunk
still held after retention: ``log_start``). Per chunk: 48 bytes and O(1) work; nothing per
record. Offsets of chunks compacted away or lost leave gaps, as in Kafka's compacted topics.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections import deque

import numpy as np

RECENT = 5      # batches per producer whose offsets a duplicate's answer names (Kafka's 5)


W = 6           # a row: base, end, group, segment, offset in it, size
BASE, END, GROUP, SEG, OFF, SIZE = range(W)
_ROW = struct.Struct(f"={W}q")   # a row as ``rows`` holds it: one copy, not six appends


class OffsetLog:
    """The rows are one flat array, ``W`` numbers a row: a streamlet holding one chunk costs
    one array (its Python objects are what the broker's cyclic collector walks, once per
    streamlet made), and the producers' recent batches and the rows of chunks written
    before offsets were kept are made only when there are some."""

    __slots__ = ("rows", "next", "durable", "first", "unsorted", "unknown", "recent")

    def __init__(self):
        self.rows = array("q")
        self.next = 0           # the offset the next record gets (Kafka's log end offset)
        self.durable = 0        # rows below are durable: the high watermark is their end
        self.first = 0          # rows below were freed (retention)
        self.unsorted = False   # replayed out of offset order: ``finish`` sorts
        self.unknown: list | None = None  # replayed chunks written before offsets were kept
        self.recent: dict | None = None   # producer -> deque of (last sequence, base offset)

    def __len__(self) -> int:
        return len(self.rows) // W

    def base(self, i: int) -> int:
        return self.rows[i * W]

    def end(self, i: int) -> int:
        return self.rows[i * W + END]

    def place(self, i: int) -> tuple[int, int, int]:
        """(group, segment, offset in it) of row ``i``."""
        j = i * W
        return self.rows[j + GROUP], self.rows[j + SEG], self.rows[j + OFF]

    def row(self, i: int) -> tuple[int, int, int, int, int, int]:
        """(base, end, group, segment, offset, size) of row ``i``."""
        return tuple(self.rows[i * W:i * W + W])

    @property
    def last_base(self) -> int:
        """The base offset of the newest row (the chunk just appended)."""
        return self.rows[-W]

    def append(self, count: int, group: int, seg: int, off: int, size: int) -> int:
        """A chunk of ``count`` records just appended at [group, seg, off]: its base offset."""
        base = self.next
        self.rows.frombytes(_ROW.pack(base, base + count, group, seg, off, size))
        self.next = base + count
        return base

    def replayed(self, base: int | None, count: int, group: int, seg: int, off: int,
                 size: int) -> None:
        """A chunk placed by a recovery, its base offset from its header (None: a chunk
        written before offsets were kept, numbered by ``finish``)."""
        if base is None:
            if self.unknown is None:
                self.unknown = []
            self.unknown.append((group, seg, off, count, size))
            return
        rows = self.rows
        if rows and base < rows[-W]:
            self.unsorted = True
        rows.frombytes(_ROW.pack(base, base + count, group, seg, off, size))
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
            self.replayed(None, n, group, seg, off, end - off)
        if not known.any():
            return
        bases = kafka[known].astype(np.int64) - 1
        tops = bases + records[known].astype(np.int64)
        rows = self.rows
        if rows and bases[0] < rows[-W]:
            self.unsorted = True
        block = np.empty((len(bases), W), np.int64)
        block[:, BASE], block[:, END], block[:, GROUP], block[:, SEG] = bases, tops, group, seg
        block[:, OFF], block[:, SIZE] = starts[known], (ends - starts)[known]
        rows.frombytes(block.tobytes())
        self.next = max(self.next, int(tops.max()))

    def finish(self) -> None:
        """A recovery placed every chunk: rows in offset order, unknown ones numbered after."""
        if self.unsorted:
            self.first = 0   # rows adopted may go before the retention cursor: looked at again
            block = np.frombuffer(self.rows, np.int64).reshape(-1, W)
            block = block[np.argsort(block[:, BASE], kind="stable")]
            self.rows = array("q", block.tobytes())
            self.unsorted = False
        for group, seg, off, count, size in sorted(self.unknown or ()):
            self.append(count, group, seg, off, size)
        self.unknown = None
        n = len(self)
        self.durable = min(self.durable, n)
        self.first = min(self.first, n)

    def find(self, offset: int) -> int:
        """The row of the first chunk holding ``offset`` or, in a gap, the first after it."""
        i = bisect_right(range(len(self)), offset, key=self.base) - 1
        if i < 0:
            return 0
        return i if self.rows[i * W + END] > offset else i + 1

    def high_watermark(self, held) -> int:
        """The end of the durable prefix of rows (``held(group, seg)`` is the segment, or None
        once freed: a freed one was durable)."""
        rows = self.rows
        i, n = self.durable, len(self)
        while i < n:
            j = i * W
            seg = held(rows[j + GROUP], rows[j + SEG])
            if seg is not None and seg.durable < rows[j + OFF] + rows[j + SIZE]:
                break
            i += 1
        self.durable = i
        return rows[(i - 1) * W + END] if i else (rows[BASE] if n else self.next)

    def log_start(self, held) -> int:
        """The first offset still held (retention frees segments from the front)."""
        rows = self.rows
        i, n = self.first, len(self)
        while i < n and held(rows[i * W + GROUP], rows[i * W + SEG]) is None:
            i += 1
        self.first = i
        return rows[i * W] if i < n else self.next

    def by_time(self, ts_of, ts: int, held) -> int:
        """The first offset whose chunk's newest record is at or after ``ts`` (ms), the log
        end if none: a bisection over chunks by ``ts_of(row)`` (their newest timestamp),
        which producers make rise per partition as Kafka assumes."""
        lo, hi = self.first, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            t = ts_of(mid)
            if t is None or t < ts:
                lo = mid + 1
            else:
                hi = mid
        return self.rows[lo * W] if lo < len(self) else self.next

    def remember(self, producer: int, last_seq: int, base: int) -> None:
        """A producer's batch just appended: a resend of it is answered with ``base``."""
        if self.recent is None:
            self.recent = {}
        d = self.recent.get(producer)
        if d is None:
            d = self.recent[producer] = deque(maxlen=RECENT)
        d.append((last_seq, base))

    def duplicate_base(self, producer: int, last_seq: int) -> int:
        """The base offset a duplicate batch was given, -1 if no longer known."""
        for s, b in (self.recent or {}).get(producer, ()):
            if s == last_seq:
                return b
        return -1
