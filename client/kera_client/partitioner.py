"""Choosing a streamlet for a record: by key hash, or sticky round-robin."""

from __future__ import annotations

import xxhash


def key_streamlet(key: bytes, streamlets: int) -> int:
    return xxhash.xxh32_intdigest(key) % streamlets


class RoundRobin:
    """Sticks to one streamlet per stream until its chunk is sealed, then moves on
    (as Kafka's sticky partitioner: full chunks instead of many small ones)."""

    def __init__(self):
        self.current: dict[int, int] = {}

    def streamlet(self, stream_id: int, streamlets: int) -> int:
        return self.current.setdefault(stream_id, stream_id % streamlets)

    def sealed(self, stream_id: int, streamlets: int) -> None:
        self.current[stream_id] = (self.current.get(stream_id, 0) + 1) % streamlets
