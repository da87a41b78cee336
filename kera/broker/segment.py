"""Segment: a fixed-capacity in-memory buffer of back-to-back chunks.

Backed by an anonymous mmap, so capacity costs address space only until it
is written: idle streams stay cheap. ``head`` is where the next chunk goes,
``durable`` how far chunks are on all copies (consumers stop there).
"""

from __future__ import annotations

import mmap
from bisect import bisect_right


class Segment:
    __slots__ = ("id", "capacity", "buf", "view", "head", "durable", "ends")

    def __init__(self, id: int, capacity: int):
        self.id = id
        self.capacity = capacity
        self.buf = mmap.mmap(-1, capacity)
        self.view = memoryview(self.buf)
        self.head = 0
        self.durable = 0
        self.ends: list[int] = []  # end offset of each chunk, to cut reads at chunk boundaries

    def room(self) -> int:
        return self.capacity - self.head

    def append(self, chunk) -> int:
        """One memcpy; returns the chunk's offset."""
        off = self.head
        end = off + len(chunk)
        assert end <= self.capacity, "caller checks room()"
        self.view[off:end] = chunk
        self.head = end
        self.ends.append(end)
        return off

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
