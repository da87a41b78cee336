"""A consumer position inside a group: (segment, offset) packed in one int.

The same placement is written in every chunk header, so a position means the
same on the broker that wrote it, on the one that recovered it, and in a
consumer's or Spark's checkpoint. ``DONE`` is past every position: the group
is closed and was read to its end.
"""

from __future__ import annotations

DONE = -1
SEG_SHIFT = 32
OFF_MASK = (1 << SEG_SHIFT) - 1


def pack(segment: int, offset: int) -> int:
    return (segment << SEG_SHIFT) | offset


def unpack(pos: int) -> tuple[int, int]:
    return pos >> SEG_SHIFT, pos & OFF_MASK
