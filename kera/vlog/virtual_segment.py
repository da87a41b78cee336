"""VirtualSegment: the open/closed unit of a virtual log.

It holds references (physical segment, offset, length) to chunks that live
in streamlets' segments, and counts its virtual size by their lengths. Each
virtual segment has its own R-1 backups; ``copies`` maps a backup id to the
bytes that backup acknowledged. The checksum is xxh3 over the chunks'
body checksums, in order: what a backup holds can be checked against it.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right

import xxhash


class VirtualSegment:
    __slots__ = ("id", "capacity", "refs", "ends", "size", "closed", "copies", "failed",
                 "durable", "sums", "close_sent", "queued")

    def __init__(self, id: int, capacity: int):
        self.id = id
        self.capacity = capacity
        self.refs: list[tuple] = []  # (segment, offset, length)
        self.ends: list[int] = []    # cumulative byte end of each ref
        self.size = 0
        self.closed = False
        self.copies: dict[int, int] = {}   # backup id -> bytes acknowledged
        self.failed: set[int] = set()      # backups that failed for this segment
        self.durable = 0                   # refs on all copies (first time through)
        self.sums = array("Q")             # the chunks' body checksums, in order
        self.close_sent: set[int] = set()
        self.queued = False  # in its vlog's pending list

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

    def parts(self, start: int, stop: int) -> list[memoryview]:
        return [seg.view[off:off + n] for seg, off, n in self.refs[start:stop]]
