"""What a reader hands out: ``Chunk`` (zero-copy, its view made when first used) and ``Record``."""

from __future__ import annotations

from collections import namedtuple

from kera import chunk as chunkfmt

Record = namedtuple("Record", "stream streamlet key value timestamp")


class Chunk:
    """A chunk as received: where it came from, and zero-copy access to its records (its
    ``view`` is made, and the chunk's offsets checked, when first asked for).

    ``skip``: how many of its first records its consumer group had already consumed
    (a group may stop in the middle of a chunk); they are left out of ``len``,
    ``values``, ``keys`` and ``records``."""

    __slots__ = ("stream", "streamlet", "group", "position", "skip", "_buf", "_at", "_records",
                 "_view")

    def __init__(self, stream, streamlet, group, position, buf, at: int, records: int, skip: int = 0):
        self.stream, self.streamlet, self.group, self.position = stream, streamlet, group, position
        self._buf, self._at, self._records, self._view = buf, at, records, None
        self.skip = skip

    @classmethod
    def of(cls, stream, streamlet, group, position, view: chunkfmt.ChunkView, skip: int = 0) -> Chunk:
        c = cls(stream, streamlet, group, position, view.buf, 0, len(view), skip)
        c._view = view
        return c

    @property
    def view(self) -> chunkfmt.ChunkView:
        v = self._view
        if v is None:
            v = self._view = chunkfmt.ChunkView(self._buf, self._at)
        return v

    def __len__(self):
        return self._records - self.skip

    @property
    def producer(self) -> int:
        return self.view.header.producer_id

    @property
    def sequence(self) -> int:
        return self.view.header.sequence

    def values(self) -> list[bytes]:
        v = self.view.values()
        return v[self.skip:] if self.skip else v

    def keys(self) -> list[bytes | None]:
        return self.view.keys()[self.skip:]

    def records(self):
        for n, (k, v, t) in enumerate(self.view.records()):
            if n >= self.skip:
                yield Record(self.stream, self.streamlet, k, v, t)
