"""The producer's chunks before they leave: records gathered per streamlet, packed per request.

An ``Outgoing`` chunk collects one streamlet's records as plain lists while it is
open; sealing gives it its sequence and its size but packs nothing. The chunks
of a request are packed together, just before it is sent, by ``pack``: one
``chunk.pack_many`` pass over all of them (header fields as arrays, one
buffer), so a chunk of one record costs a few list operations, not a build.
A chunk keeps its bytes once packed: a resend sends the same ones.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from kera import chunk as chunkfmt


class Outgoing:
    """One chunk: open (records still arrive), sealed (``seq`` set) and then packed (``data``)."""

    __slots__ = ("key", "values", "keys", "ts", "size", "deadline", "created", "sticky", "seq",
                 "records", "data", "start", "flags", "charged", "wall", "reports")

    def __init__(self, key: tuple, created: float, deadline: float, sticky: bool):
        self.key = key
        self.values: list[bytes] = []
        self.keys: list[bytes | None] | None = None   # only once a record has a key
        self.ts: list[int] | None = None              # only once a record has its own timestamp
        self.size = 0           # open: 16 + key + value per record; sealed: the chunk's bytes
        self.created = created  # the first record's arrival: latencies count from here
        self.deadline = deadline
        self.sticky = sticky    # the round-robin streamlet of its stream, until sealed
        self.seq = -1
        self.records = 0
        self.data = None        # once packed: the buffer holding the chunk at ``start``
        self.start = 0          # (its request's payload: no per-chunk object)
        self.flags = 0
        self.charged = 0        # bytes counted against buffer.memory until acked or given up
        self.wall = 0           # the records' timestamp, for those without their own
        self.reports = None     # its records' delivery callbacks (``delivery``), if any

    def chunk(self):
        """The packed chunk's bytes."""
        if self.start == 0 and len(self.data) == self.size:
            return self.data
        return memoryview(self.data)[self.start:self.start + self.size]

    def seal(self, seq: int, wall_ms: int) -> None:
        self.seq = seq
        self.records = len(self.values)
        self.wall = wall_ms
        self.size = chunkfmt.chunk_size(self.records, self.size - 16 * self.records)

    @classmethod
    def packed(cls, key: tuple, seq: int, data, records: int, created: float, reports=None) -> Outgoing:
        """A chunk built elsewhere (the columnar path)."""
        c = cls(key, created, created, False)
        c.seq, c.data, c.records, c.size, c.reports = seq, data, records, len(data), reports
        return c


def pack(items: list[Outgoing], producer_id: int) -> bytes | None:
    """Pack every chunk of ``items`` not packed yet, all in one pass; returns the request's
    payload when that was all of them (else the caller joins the chunks' own bytes)."""
    todo = [c for c in items if c.data is None]
    if not todo:
        return None
    counts = [c.records for c in todo]
    values = list(chain.from_iterable(c.values for c in todo))
    keys = None
    if any(c.keys is not None for c in todo):
        keys = list(chain.from_iterable(c.keys if c.keys is not None else [None] * c.records
                                        for c in todo))
    if any(c.ts is not None for c in todo):
        ts = list(chain.from_iterable(c.ts if c.ts is not None else [c.wall] * c.records for c in todo))
    else:
        ts = np.repeat(np.fromiter([c.wall for c in todo], np.int64, len(todo)), counts)
    data, starts, sizes = chunkfmt.pack_many(
        [c.key[0] for c in todo], [c.key[1] for c in todo], producer_id, [c.seq for c in todo],
        [c.flags for c in todo], counts, values, keys, ts)
    for c, s in zip(todo, starts, strict=True):
        c.data, c.start = data, s
        c.values = c.keys = c.ts = None  # the bytes are in the chunk now
    return data if len(todo) == len(items) else None
