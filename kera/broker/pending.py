"""Pending: a streamlet's groups of dead incarnations still to be adopted after it serves.

A recovery hands a streamlet over before its closed history is adopted
(``kera.recovery.adoption``): per dead incarnation (its source), the ids of those groups as
``[lo, hi]`` ranges and, per slot, the newest of them. Until a source is adopted the
streamlet refuses reads that reach its groups (``check``), gives no new group their ids
(``top``), closes the groups it holds among or older than them (``covers``, ``slot_tops``)
and counts them as read for a reader starting at the end (``done``). A range is as long
as the groups it holds: nothing here walks one id by id but ``done``, which says each.
"""

from __future__ import annotations

from ..errors import Recovering
from ..position import DONE


class Pending:
    """Per source ``(broker, incarnation)``: its ranges and its newest group per slot.
    Truthy while a source is pending; ``source in pending`` asks for one."""

    __slots__ = ("ranges", "tops")

    def __init__(self):
        self.ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.tops: dict[tuple[int, int], dict[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __contains__(self, source) -> bool:
        return source in self.ranges

    def add(self, source: tuple[int, int], ranges, tops: dict) -> None:
        self.ranges[source] = sorted((lo, hi) for lo, hi in ranges)
        self.tops[source] = dict(tops)

    def drop(self, source: tuple[int, int]) -> bool:
        """``source`` adopted; False if it was not pending."""
        if source not in self.ranges:
            return False
        del self.ranges[source], self.tops[source]
        return True

    def top(self) -> int:
        """The newest pending group id, -1 if none."""
        return max((hi for rs in self.ranges.values() for _, hi in rs), default=-1)

    def covers(self, gid: int) -> bool:
        return any(lo <= gid <= hi for rs in self.ranges.values() for lo, hi in rs)

    def slot_tops(self) -> dict[int, int]:
        """Per slot, its newest pending group over every source."""
        tops: dict[int, int] = {}
        for t in self.tops.values():
            for slot, top in t.items():
                tops[slot] = max(tops.get(slot, -1), top)
        return tops

    def check(self, low: int, positions: dict, where: str) -> None:
        """``Recovering`` if a reader at ``positions`` may reach a pending group: one at or
        past ``low`` it has not read to its end."""
        for rs in self.ranges.values():
            for lo, hi in rs:
                if hi < low:
                    continue
                start = max(lo, low)
                done = sum(1 for gid, pos in positions.items() if start <= gid <= hi and pos == DONE)
                if done < hi - start + 1:
                    raise Recovering(f"{where}: groups {start}-{hi} of a recovered broker's "
                                     f"history are being adopted; retry")

    def done(self) -> dict[int, int]:
        """Every pending group as read to its end (``DONE``)."""
        out: dict[int, int] = {}
        for rs in self.ranges.values():
            for lo, hi in rs:
                out.update(dict.fromkeys(range(lo, hi + 1), DONE))
        return out
