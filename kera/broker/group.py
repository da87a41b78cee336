"""Group: a sub-partition of a streamlet, made of up to G segments.

An active group accepts appends; once its G-th segment is full it closes and
becomes immutable. Retention frees a group's oldest segments whole: ``start``
is its first segment still held, and a reader positioned before it gets
``OutOfRange``. A consumer position in a group is (segment, offset),
packed in one int (``kera.position``). The same placement is written in
every chunk header, so positions survive recovery.
"""

from __future__ import annotations

from bisect import bisect_left

from ..errors import DataLoss, OutOfRange
from ..position import DONE, pack, unpack
from .segment import Segment, buffer_size


class Group:
    __slots__ = ("id", "slot", "segment_size", "max_segments", "segments", "closed", "vlog", "memory",
                 "start", "owner")

    def __init__(self, id: int, slot: int, segment_size: int, max_segments: int, memory=None):
        self.id = id
        self.slot = slot  # the active-group slot (producer id % Q) it was opened for
        self.segment_size = segment_size
        self.max_segments = max_segments
        self.segments: list[Segment] = []
        self.closed = False
        self.vlog = None  # the virtual log its chunks go to (one per group, fixed once chosen)
        self.memory = memory  # the broker's budget, charged for every buffer allocated
        self.start = 0        # segments below were freed by retention
        self.owner = None  # its streamlet: ``mark_filled(group, segment)`` when a segment takes no more chunks

    def _filled(self, seg: Segment) -> None:
        if self.owner is not None:
            self.owner.mark_filled(self, seg)

    def append(self, chunk) -> tuple[Segment, int] | None:
        """Append one chunk; None if the group is full (it is then closed). A segment noted
        filled takes no more chunks, even one that fits, when the budget refused the next
        segment: the budget may evict it from then on."""
        n = len(chunk)
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.room() < n or seg.filled_at:
            if len(self.segments) >= self.max_segments:
                self.closed = True
                self._filled(seg)
                return None
            if seg is not None:
                self._filled(seg)
            seg = self._segment(n)
        elif seg.held - seg.head < n:   # its buffer is full: it grows
            self._grow(seg, n)
        return seg, seg.append(chunk)

    def place(self, segment: int, offset: int, chunk, late_start: bool = False) -> Segment | None:
        """Recovery append at a recorded placement; None if already there (a replayed copy).

        A group's chunks are replayed in the order they were appended, so a
        placement past the end (a hole) means the chunks before it were lost
        on every copy: refused with ``DataLoss``, never stored over the hole.
        """
        n = len(self.segments)
        # ``late_start`` (the stream has retention): the group's first segments may have been
        # freed on the dead broker; without retention a late start is a hole like any other
        if late_start and n == 0 and (segment > 0 or offset > 0):
            if offset != 0:
                # the rest of a segment whose start was freed by retention before the copies of
                # its first chunks were released: not kept (retention frees whole segments)
                return None
            # the first segment retained: the ones before it were freed on the dead broker
            self.segments = [Segment.gone(i) for i in range(segment)]
            self.start = n = segment
        head = self.segments[segment].head if segment < n else 0
        if segment < n and offset < head:
            return None
        # every segment gets a chunk when it is created: skipping one is a hole too
        if offset != head or segment > n:
            where = f"segment {segment} offset {offset}"
            have = f"segment {segment} ends at {head}" if segment < n else f"{n} segments"
            err = DataLoss(f"hole in group {self.id} before {where} ({have}): the chunks before it "
                           f"were lost on every copy")
            err.group, err.segment, err.offset = self.id, segment, offset
            raise err
        if segment == n:
            if n > self.start and not self.segments[-1].evicted:  # adopted ones were noted filled
                self._filled(self.segments[-1])
            self._segment(len(chunk))
        seg = self.segments[segment]
        if seg.space() < len(chunk):
            self._grow(seg, len(chunk))
        seg.append(chunk)
        return seg

    def _segment(self, first: int) -> Segment:
        """A new segment, its buffer (charged) sized for its ``first`` chunk or for what the
        segment before it in the group held: a group filling its segments keeps its pace
        without growing each one from small (and copying its bytes again)."""
        before = self.segments[-1].head if self.segments else 0
        size = buffer_size(max(first, before), self.segment_size)
        if self.memory is not None:
            self.memory.reserve(size)
        seg = self.new_segment(len(self.segments), size)
        self.segments.append(seg)
        return seg

    def new_segment(self, id: int, size: int) -> Segment:
        return Segment(id, self.segment_size, size)

    def _grow(self, seg: Segment, n: int) -> None:
        """``seg``'s buffer doubles (or more, for a large chunk) to take ``n`` bytes more; the
        budget is charged the difference first (``BrokerFull``: nothing changed)."""
        size = buffer_size(max(seg.head + n, 2 * seg.held), self.segment_size)
        if self.memory is not None:
            self.memory.reserve(size - seg.held)
        seg.grow(size)

    def free_front(self) -> Segment:
        """Retention: the oldest segment held goes (the caller frees its bytes)."""
        seg = self.segments[self.start]
        self.start += 1
        return seg

    def gone(self) -> bool:
        """Closed and every segment freed: nothing of it is left to read."""
        return self.closed and self.start >= len(self.segments)

    def first(self) -> int:
        """The first position still held."""
        return pack(self.start, 0)

    def durable_end(self) -> int:
        """Just past the durable prefix: never ahead of a segment whose tail is not durable yet
        (a new last segment with durable 0 must not vouch for the end of the one before)."""
        for seg in self.segments[self.start:]:
            if seg.durable < seg.head:
                return pack(seg.id, seg.durable)
        if not self.segments:
            return 0
        seg = self.segments[-1]
        return pack(seg.id, seg.durable)

    def align(self, pos: int) -> int:
        """The first chunk boundary at or after ``pos`` (which may point inside a chunk)."""
        if pos == DONE:
            return DONE
        si, off = unpack(pos)
        if si >= len(self.segments) or off == 0:
            return pos
        seg = self.segments[si]
        i = bisect_left(seg.ends, off)
        return pack(si, seg.ends[i]) if i < len(seg.ends) else pack(si, seg.head)

    def finished(self) -> bool:
        """Closed, and everything in it is durable: a reader at its end is done."""
        return self.closed and all(s.durable == s.head for s in self.segments)

    def read(self, pos: int, max_bytes: int):
        """(segment, offset, length, next_pos) of the durable chunks after ``pos``.

        ``length`` may be 0 when there is nothing new; ``next_pos`` is DONE
        when the group is finished and fully read.
        """
        si, off = unpack(pos)
        if si < self.start:
            err = OutOfRange(f"group {self.id} position {si}:{off} is before its first retained "
                             f"segment {self.start}")
            raise err
        while si < len(self.segments):
            seg = self.segments[si]
            start, n, off = seg.span(off, max_bytes)
            if n:
                return si, start, n, pack(si, off)
            if off >= seg.head and seg.durable == seg.head and si + 1 < len(self.segments):
                si, off = si + 1, 0
                continue
            break
        if self.finished() and (si >= len(self.segments) - 1) and \
                (not self.segments or off >= self.segments[-1].head):
            return si, off, 0, DONE
        return si, off, 0, pack(si, off)
