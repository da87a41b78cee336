"""Which broker incarnation owns which streamlets: the coordinator's index over its metadata.

With 100,000 streams, finding a dead broker's streamlets or a live one's load
by walking every stream costs tens of milliseconds, and the recovery manager
asks several times a second. This index answers both in time proportional to
the number of incarnations; it is kept in step wherever an owner changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .stream_meta import StreamMeta

Incarnation = tuple[int, int]       # (broker id, epoch)
StreamletRef = tuple[str, int]      # (stream name, index)


class Holdings:
    def __init__(self, streams: Iterable[StreamMeta] = ()):
        self._by: dict[Incarnation, dict[StreamletRef, None]] = {}   # insertion-ordered sets
        for s in streams:
            self.add(s)

    def add(self, s: StreamMeta) -> None:
        """Every streamlet of ``s`` under its recorded owner."""
        for i, (b, e) in enumerate(s.owners):
            self._by.setdefault((b, e), {})[(s.name, i)] = None

    def remove(self, s: StreamMeta) -> None:
        for i, (b, e) in enumerate(s.owners):
            held = self._by.get((b, e))
            if held is not None:
                held.pop((s.name, i), None)
                if not held:
                    del self._by[(b, e)]

    def move(self, name: str, i: int, old: Incarnation, new: Incarnation) -> None:
        held = self._by.get(old)
        if held is not None:
            held.pop((name, i), None)
            if not held:
                del self._by[old]
        self._by.setdefault(new, {})[(name, i)] = None

    def count(self, owner: Incarnation) -> int:
        return len(self._by.get(owner, ()))

    def orphans(self, alive: Callable[[int, int], bool]) -> dict[Incarnation, list[StreamletRef]]:
        """The streamlets of every incarnation that ``alive`` says is gone."""
        return {key: list(held) for key, held in self._by.items() if not alive(*key)}
