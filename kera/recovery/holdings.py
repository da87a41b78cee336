"""Which broker incarnation owns which streamlets: the coordinator's index over its metadata.

With 100,000 streams, finding a dead broker's streamlets or a live one's load
by walking every stream costs tens of milliseconds, and the recovery manager
asks several times a second. This index answers both in time proportional to
the number of incarnations (and the streamlets asked for); it is kept in step
wherever an owner changes.

Per incarnation, each stream it serves maps to a bit set of its streamlets (an
int): a stream of one streamlet costs one dict slot, whose value is the small
int 1, shared by all of them.
"""

from __future__ import annotations

from collections.abc import Callable

Incarnation = tuple[int, int]       # (broker id, epoch)
StreamletRef = tuple[str, int]      # (stream name, index)


class Holdings:
    def __init__(self):
        self._by: dict[Incarnation, dict[str, int]] = {}   # name -> bits of its streamlets
        self._count: dict[Incarnation, int] = {}

    def add(self, name: str, owners) -> None:
        """Every streamlet of stream ``name`` under its recorded owner (``owners[i]``)."""
        for i, (b, e) in enumerate(owners):
            self._put((b, e), name, i)

    def remove(self, name: str, owners) -> None:
        for i, (b, e) in enumerate(owners):
            self._drop((b, e), name, i)

    def move(self, name: str, i: int, old: Incarnation, new: Incarnation) -> None:
        self._drop(tuple(old), name, i)
        self._put(tuple(new), name, i)

    def _put(self, key: Incarnation, name: str, i: int) -> None:
        held = self._by.get(key)
        if held is None:
            held = self._by[key] = {}
            self._count[key] = 0
        bits = held.get(name, 0)
        if not bits >> i & 1:
            held[name] = bits | 1 << i
            self._count[key] += 1

    def _drop(self, key: Incarnation, name: str, i: int) -> None:
        held = self._by.get(key)
        if held is None:
            return
        bits = held.get(name, 0)
        if bits >> i & 1:
            bits &= ~(1 << i)
            if bits:
                held[name] = bits
            else:
                del held[name]
            self._count[key] -= 1
            if not held:
                del self._by[key], self._count[key]

    def holds(self, key: Incarnation, name: str, i: int) -> bool:
        """Whether incarnation ``key`` owns streamlet ``i`` of stream ``name``."""
        held = self._by.get(tuple(key))
        return held is not None and held.get(name, 0) >> i & 1 == 1

    def count(self, owner: Incarnation) -> int:
        return self._count.get(tuple(owner), 0)

    def dead(self, alive: Callable[[int, int], bool]) -> list[Incarnation]:
        """The incarnations owning streamlets that ``alive`` says are gone (their streamlets
        are listed only for a recovery that starts: after a whole-cluster restart that is
        every streamlet, which the recovery manager must not list ten times a second)."""
        return [key for key in self._by if not alive(*key)]

    def streamlets(self, key: Incarnation) -> list[StreamletRef]:
        """The streamlets incarnation ``key`` owns."""
        return [(name, i) for name, bits in self._by.get(key, {}).items() for i in _ones(bits)]

    def orphans(self, alive: Callable[[int, int], bool]) -> dict[Incarnation, list[StreamletRef]]:
        """The streamlets of every incarnation that ``alive`` says is gone."""
        return {key: self.streamlets(key) for key in self.dead(alive)}


def _ones(bits: int):
    """The indexes of the bits set in ``bits``, lowest first."""
    i = 0
    while bits:
        if bits & 1:
            yield i
        bits >>= 1
        i += 1
