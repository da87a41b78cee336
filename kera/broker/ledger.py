"""The broker's ledger over all its streamlets."""

from __future__ import annotations


class Ledger:
    """What a broker keeps over all its streamlets, updated as they change, so that nothing
    periodic or per request walks every streamlet: the chunks and bytes appended (stats),
    the streamlets under retention holding filled segments (the reclaim pass) and those of
    compacted streams (the compactor). The sets are dicts, in the order streamlets joined."""

    __slots__ = ("chunks", "bytes", "expiring", "compacted")

    def __init__(self):
        self.chunks = self.bytes = 0
        self.expiring: dict = {}    # Streamlet -> None
        self.compacted: dict = {}   # Streamlet -> None

    def clear(self) -> None:
        self.chunks = self.bytes = 0
        self.expiring.clear()
        self.compacted.clear()
