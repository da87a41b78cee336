"""VirtualSegment: the open/closed unit of a virtual log.

It holds references (physical segment, offset, length) to chunks that live
in streamlets' segments, and counts its virtual size by their lengths. Each
virtual segment has its own backups; ``copies`` maps a backup id to that
copy's replication state. The checksum is xxh3 over the chunks' body
checksums, in order: what a backup holds can be checked against it.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right

import xxhash


class Copy:
    """One backup's copy of a virtual segment, as the broker drives it."""

    __slots__ = ("backup", "incarnation", "acked", "closed", "inflight", "sent", "fails", "since",
                 "retry_at")

    def __init__(self, backup: int, incarnation: int):
        self.backup = backup
        self.incarnation = incarnation  # of the backup process: a restarted one is asked again
        self.acked = 0          # bytes the backup acknowledged (a prefix)
        self.closed = False     # the backup acknowledged the close
        self.inflight: list[int] = []  # tokens of the replicates out now, in the order sent
        self.sent = 0           # bytes those replicates carry it to (the next one starts there)
        self.fails = 0          # failed attempts since the last progress
        self.since = 0.0        # when the current streak of attempts began
        self.retry_at = 0.0     # no new attempt before this time (backoff)


class VirtualSegment:
    __slots__ = ("id", "capacity", "refs", "ends", "size", "closed", "copies", "avoid",
                 "confirmed", "durable", "sums", "live", "frozen", "released")

    def __init__(self, id: int, capacity: int):
        self.id = id
        self.capacity = capacity
        self.refs: list[tuple] = []  # (segment, offset, length)
        self.ends: list[int] = []    # cumulative byte end of each ref
        self.size = 0
        self.closed = False
        self.copies: dict[int, Copy] = {}
        self.avoid: dict[int, float] = {}  # backups given up on for this vseg -> until when
        self.confirmed = 0   # refs that were on every copy once (first time through): never shrinks
        self.durable = 0     # refs whose segments' durable heads were moved (<= confirmed)
        self.sums = array("Q")             # the chunks' body checksums, in order
        self.live = 0        # broker segments with chunks here that are not freed (retention)
        self.frozen = False  # some of its chunks left broker memory: the vlog sends it no more
        self.released = False  # below the vlog's floor: nothing live, its files may go

    def whole_on(self, alive) -> list[int]:
        """Backups ``alive`` (a predicate) holding this vseg whole and closed."""
        return [b for b, c in self.copies.items() if c.closed and c.acked == self.size and alive(b)]

    def release(self) -> None:
        """Nothing live references it any more: forget the refs (and with them the segments)."""
        self.released = True
        self.refs, self.ends, self.sums = [], [], array("Q")
        self.copies, self.avoid = {}, {}

    def has_room(self, length: int) -> bool:
        return not self.closed and (self.size == 0 or self.size + length <= self.capacity)

    def add(self, segment, offset: int, length: int, body_checksum: int) -> int:
        self.refs.append((segment, offset, length))
        self.size += length
        self.ends.append(self.size)
        self.sums.append(body_checksum)
        return len(self.refs) - 1

    @property
    def checksum(self) -> int:
        """xxh3 over the chunks' checksums: what a backup's copy must also give."""
        return xxhash.xxh3_64_intdigest(self.sums.tobytes())

    def index_at(self, byte_offset: int) -> int:
        """Index of the first ref starting at or after ``byte_offset``."""
        return bisect_right(self.ends, byte_offset)

    def boundary(self, byte_offset: int) -> bool:
        """Whether ``byte_offset`` is where a chunk starts or the segment ends."""
        i = self.index_at(byte_offset)
        return byte_offset == 0 or (i > 0 and self.ends[i - 1] == byte_offset)

    def parts(self, start: int, stop: int) -> list[memoryview]:
        return [seg.view[off:off + n] for seg, off, n in self.refs[start:stop]]
