"""Segment: a buffer of back-to-back chunks, of a fixed *logical* capacity.

Chunk positions [group, segment, offset] and everything computed from them
(recovery, replay, re-pointing, eviction, tiered reads, retention,
compaction) see a segment of ``capacity`` bytes. Its *physical* buffer is
sized to what it holds: it starts at its first chunk (rounded up to a power of
two, at least ``MIN_BUFFER``), or at what the segment before it in its group
held, and doubles, up to ``capacity``, as chunks arrive (``grow``, driven by
``Group``, which charges the broker's budget for it). A stream holding one
small record costs a few hundred bytes, not a segment; growing costs at most
one more copy of each byte, and a group filling its segments grows only its
first. ``held`` is what the buffer takes: the budget charges exactly that.

A grown buffer is a new buffer: the old one is never resized, since slices
of it (a pull's reply, a replicate in flight) may still be out; they stay
valid on the old buffer until dropped. Bytes once appended never change, so
the old buffer's slices and the new buffer agree. Buffers from ``MMAP_BUFFER``
up are private anonymous mmaps, given back to the kernel at once when dropped
(the allocator would keep a freed large block in its heap); the kernel merges
adjacent private anonymous mappings into one area, while shared ones
(mmap's default) each take one of the process's ``vm.max_map_count`` areas
(65,530 by default). Smaller ones are bytearrays. ``head`` is where the next
chunk goes, ``durable`` how far chunks are on all copies (consumers stop
there).

Each chunk also records where its vlog put it (virtual segment id, byte
offset there): once the segment is full and its virtual segments are fully
replicated, the buffer can be *evicted* and the chunks read back from a
backup's copy (``kera.broker.tiered``), or *freed* for good by retention.

Key compaction (``kera.broker.compactor``) replaces a closed segment's bytes
with a ``Compacted`` copy: fewer chunks, each at its original placement, so
positions keep their meaning (a reader's position maps to the first
surviving chunk at or after it). ``span`` and ``part`` read both kinds.
"""

from __future__ import annotations

import mmap
import time
from array import array
from bisect import bisect_left, bisect_right
from struct import Struct

from ..chunk import HEADER_DTYPE

RECORD_COUNT = HEADER_DTYPE.fields["record_count"][1]   # its offset in a chunk's header
_RECORDS = Struct("<I")

MIN_BUFFER = 256         # bytes of the smallest buffer (a chunk of one small record fits)
MMAP_BUFFER = 256 << 10  # buffers from this size up are mmaps, smaller ones bytearrays


def buffer_size(need: int, capacity: int) -> int:
    """The buffer for ``need`` bytes: the next power of two (at least ``MIN_BUFFER``), at
    most ``capacity``."""
    return min(capacity, max(MIN_BUFFER, 1 << (need - 1).bit_length()))


def _buffer(size: int):
    if size >= MMAP_BUFFER:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return bytearray(size)


class Segment:
    __slots__ = ("id", "capacity", "buf", "held", "head", "durable", "ends", "vlog", "vsegs",
                 "vplaces", "filled_at", "evicted", "freed", "opened_at", "compacted",
                 "records")

    def __init__(self, id: int, capacity: int, size: int | None = None):
        """``size``: the first buffer's (``buffer_size``; by default the whole capacity)."""
        self.id = id
        self.capacity = capacity
        self.buf = _buffer(capacity if size is None else size)   # its bytes: ``view`` reads them
        self.held = len(self.buf)  # bytes its buffer takes: what the budget charges for it
        self.head = 0
        self.durable = 0
        self.ends: list[int] = []  # end offset of each chunk, to cut reads at chunk boundaries
        self.records = array("Q")  # records in the chunks up to each one (lag and records out)
        self.vlog = None           # the replicator its chunks went to (one per group)
        self.vsegs: list = []      # the distinct virtual segments holding its chunks, in order
        self.vplaces = array("Q")  # per chunk, its virtual segment id and byte offset there
                                   # (where a backup holds it): [id, offset, id, offset, ...]
        self.filled_at = 0.0       # wall time it stopped taking chunks (retention.ms)
        self.evicted = False       # buffer dropped, chunks on backups only
        self.freed = False         # retention or deletion: gone for good
        self.opened_at = time.time()  # segment.ms rolls a compacted stream's segment after this
        self.compacted = None      # a Compacted copy replacing the bytes (key compaction)

    @classmethod
    def gone(cls, id: int) -> Segment:
        """A placeholder for a segment freed before this broker held its group (recovery)."""
        seg = cls.__new__(cls)
        seg.id, seg.capacity, seg.buf = id, 0, None
        seg.held = seg.head = seg.durable = 0
        seg.ends, seg.vlog, seg.vsegs = [], None, []
        seg.records = array("Q")
        seg.vplaces = array("Q")
        seg.filled_at, seg.evicted, seg.freed = 0.0, False, True
        seg.opened_at, seg.compacted = 0.0, None
        return seg

    def room(self) -> int:
        """Bytes it may still take (of its capacity)."""
        return self.capacity - self.head

    def space(self) -> int:
        """Bytes its buffer can still take before it must grow."""
        return len(self.buf) - self.head

    def grow(self, size: int) -> None:
        """Move the bytes into a new buffer of ``size`` (the caller charged the budget). The old
        buffer is left to the slices still out of it."""
        buf = _buffer(size)
        memoryview(buf)[:self.head] = memoryview(self.buf)[:self.head]
        self.buf, self.held = buf, size

    def append(self, chunk) -> int:
        """One memcpy; returns the chunk's offset."""
        off = self.head
        end = off + len(chunk)
        assert end <= len(self.buf) and end <= self.capacity, "caller checks room() and space()"
        self.buf[off:end] = chunk   # same length: never a resize, so slices out of it stay valid
        self.head = end
        self.ends.append(end)
        rec = self.records
        rec.append((rec[-1] if rec else 0) + _RECORDS.unpack_from(chunk, RECORD_COUNT)[0])
        return off

    def records_in(self, start: int, end: int) -> int | None:
        """Records of the chunks between offsets ``start`` and ``end`` (chunk boundaries); None
        when they were not counted (chunks adopted from an index: the caller estimates)."""
        rec = self.records
        if len(rec) != len(self.ends):
            return None
        i = bisect_right(self.ends, start)
        j = bisect_right(self.ends, end)
        if j <= i:
            return 0
        return rec[j - 1] - (rec[i - 1] if i else 0)

    def noted(self, vlog, vs, vseg_offset: int) -> None:
        """Where the vlog put the chunk just appended (O(1); one new entry per new vseg)."""
        self.vlog = vlog
        if not self.vsegs or self.vsegs[-1] is not vs:
            self.vsegs.append(vs)
            vs.live += 1
        self.vplaces.append(vs.id)
        self.vplaces.append(vseg_offset)

    def replicated(self) -> bool:
        """Every vseg holding its chunks is closed and on all its copies: the bytes are safe
        on the backups and no re-replication will need them from here."""
        v = self.vlog
        return v is not None and self.durable == self.head and all(
            vs.closed and v.log.done(vs) for vs in self.vsegs)

    def drop_buffer(self) -> None:
        """Forget the bytes (slices still out, e.g. in a reply being sent, keep the mmap alive
        until they are gone; nothing here reads it again)."""
        self.buf = None
        self.compacted = None
        self.held = 0

    def readable(self, offset: int, max_bytes: int) -> int:
        """Bytes of whole durable chunks from ``offset``, at most ``max_bytes`` (but >= 1 chunk)."""
        if offset >= self.durable:
            return 0
        limit = min(self.durable, offset + max_bytes)
        i = bisect_right(self.ends, limit) - 1
        cut = self.ends[i] if i >= 0 else 0
        if cut <= offset:  # a single chunk larger than max_bytes
            cut = self.ends[bisect_right(self.ends, offset)]
        return cut - offset

    def span(self, offset: int, max_bytes: int) -> tuple[int, int, int]:
        """(start, bytes, end) of whole durable chunks from ``offset``: ``start`` the position
        of the first, ``end`` the position after the last (both in the original offsets)."""
        if self.compacted is not None:
            return self.compacted.span(offset, max_bytes, self.head)
        n = self.readable(offset, max_bytes)
        return offset, n, offset + n

    def part(self, start: int, n: int):
        """The bytes ``span`` named, None if they are not in memory (evicted)."""
        if self.compacted is not None:
            return self.compacted.part(start, n)
        return memoryview(self.buf)[start:start + n] if self.buf is not None else None

    @property
    def view(self) -> memoryview | None:
        """Its bytes without a copy (None once dropped). Made when asked, not kept: a
        memoryview and its managed buffer are 312 bytes, an eighth of what a streamlet's first
        record costs a broker (docs/retention.md)."""
        b = self.buf
        return memoryview(b) if b is not None else None


class Compacted:
    """A compacted segment's surviving chunks, back to back, and where each was:
    ``starts``/``ends`` in the original segment, ``pends`` in ``buf``."""

    __slots__ = ("buf", "starts", "ends", "pends", "records")

    def __init__(self, buf: bytes, starts: list, ends: list, pends: list, records: int):
        self.buf, self.starts, self.ends, self.pends, self.records = \
            memoryview(buf), starts, ends, pends, records

    def span(self, offset: int, max_bytes: int, head: int) -> tuple[int, int, int]:
        i = bisect_left(self.starts, offset)
        if i == len(self.starts):
            return head, 0, head
        p0 = self.pends[i - 1] if i else 0
        j = max(i, bisect_right(self.pends, p0 + max_bytes) - 1)
        return self.starts[i], self.pends[j] - p0, self.ends[j]

    def part(self, start: int, n: int) -> memoryview:
        i = bisect_left(self.starts, start)
        p0 = self.pends[i - 1] if i else 0
        return self.buf[p0:p0 + n]


class VlogChunk:
    """A chunk a vlog references that no segment holds (an index or a close chunk): replicated
    and replayed like any chunk, never read by consumers, never evicted or freed by retention.
    ``vs``: the vseg holding it; it keeps that vseg live only if a subclass says so."""

    __slots__ = ("view", "head", "durable", "vs")

    def __init__(self, data: bytes):
        self.view = memoryview(data)
        self.head = len(data)
        self.durable = 0
        self.vs = None

    def noted(self, vlog, vs, vseg_offset: int) -> None:
        self.vs = vs


def close_waiting(seg: Segment) -> bool:
    """Close the open vseg of an idle vlog that ``seg``'s chunks wait in (so they settle);
    True if one was closed (the caller pokes the vlog). Not while chunks of that vseg are
    still on their way to its copies (a busy vlog, or backups failing): a later call tries
    again. The open vseg is its vlog's newest, so it is the last one ``seg`` touched."""
    v = seg.vlog
    return v is not None and bool(seg.vsegs) and seg.vsegs[-1] is v.log.open and v.log.close_open()


def never_settles(seg: Segment) -> bool:
    """A vseg holding ``seg``'s chunks is frozen (it gets no new copy) and not settled on the
    copies it has: ``seg`` is never ``replicated``, so never evicted."""
    v = seg.vlog
    return v is not None and any(vs.frozen and not v.log.done(vs) for vs in seg.vsegs)
