"""MemoryBudget: the bound on what a broker's segments may take, and eviction.

Segments are charged what their buffers take (``Segment.held``): a buffer
starts sized to its first chunk and grows with what it holds (``Group``
charges each growth before it happens), so a stream holding one small record
costs a few hundred bytes, not a segment. The charge is credited back when a
segment is evicted, freed by retention, or its stream leaves the broker;
``used`` is always the sum of the charges of the segments held.

Brokers are a cache of the recent data: a segment that takes no more chunks
(*filled*) and whose chunks are settled on their backups (every vseg holding
them closed and on all its copies) may be *evicted*: its buffer is dropped,
only its index stays (per chunk: vseg id and offset), and reads of it are
served from a backup's copy (``kera.broker.tiered``). Eviction takes the
oldest filled segments first. A new segment is refused (``BrokerFull``) only
when the budget is spent and nothing in memory can be evicted, i.e. all of it
still waits for replication.

A filled segment whose last chunks sit in a vlog's *open* vseg never settles
while that vlog takes no more chunks, and a small budget can be spent on such
segments alone. So the background pass, still above the low-water mark after
evicting, closes the open vsegs the oldest filled segments wait in (once their
chunks are durable), as many as that excess needs: they settle, and a later
pass or allocation evicts them. A refused allocation counts in that excess
until one is taken: with segments large against the budget, the room one
needs can be held below the low-water mark (two segments of 3 KB in an 8 KB
budget are 75% of it, and refuse a third), where nothing else would ever
close those vsegs. No more are closed: a busy vlog's vseg closes when
full, and closing it early only makes small vsegs. Everything here is
decisions on the vlogs' state (no I/O): the caller pokes the vlogs it names.
"""

from __future__ import annotations

import os
from collections import OrderedDict

from ..errors import BrokerFull
from .segment import close_waiting, never_settles

LOW_WATER = 0.85   # the background pass evicts down to this fraction of the budget
SLACK = 1 / 32     # an eviction on the allocation path frees this much of the budget more


def default_budget() -> int:
    """A quarter of the machine's physical memory (``--memory`` overrides it; 0: no limit)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class MemoryBudget:
    def __init__(self, limit: int):
        self.limit = limit  # bytes; 0: no limit
        self.used = 0
        self.resident: OrderedDict = OrderedDict()  # filled segments still in memory, oldest first
        self.evictions = 0       # segments evicted, ever
        self.evicted_bytes = 0   # their chunk bytes
        self.wanted = 0          # the largest allocation refused since the last one taken

    def reserve(self, n: int) -> None:
        if self.limit and self.used + n > self.limit:
            self.evict(self.used + n - self.limit + int(self.limit * SLACK))
            if self.used + n > self.limit:
                if n <= self.limit:   # one that can never fit makes no room be kept
                    self.wanted = max(self.wanted, n)
                raise BrokerFull(f"broker memory budget of {self.limit} bytes is spent "
                                 f"({self.used} in segments not replicated yet or of compacted "
                                 f"streams, which are not evicted); no room for {n} bytes more")
        self.used += n
        self.wanted = 0

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)

    def filled(self, seg) -> None:
        """``seg`` takes no more chunks: a candidate for eviction once replicated."""
        if seg.buf is not None:
            self.resident[seg] = None

    def evict(self, need: int) -> int:
        """Evict the oldest replicated filled segments until ``need`` bytes are released."""
        freed = 0
        for seg in list(self.resident):
            if freed >= need:
                break
            if not seg.replicated():
                continue
            del self.resident[seg]
            for vs in seg.vsegs:
                vs.frozen = True  # its bytes are not all in memory any more
            seg.evicted = True
            self.used -= seg.held
            freed += seg.held
            seg.drop_buffer()
            self.evictions += 1
            self.evicted_bytes += seg.head
        return freed

    def relieve(self) -> list:
        """The background pass: evict down to the low-water mark, so allocations rarely wait
        on it, and to room for the largest allocation refused (``wanted``); what is still
        above that and waits in open vsegs gets them closed. Returns the vlogs (their
        replicators) whose open vseg was closed, for the caller to poke."""
        if not self.limit:
            return []
        excess = max(self.used - int(self.limit * LOW_WATER), self.used + self.wanted - self.limit)
        if excess <= 0:
            return []
        need = excess - self.evict(excess)
        closed = []
        for seg in self.resident:  # oldest first
            if need <= 0:
                break
            if never_settles(seg):  # never evictable: closing vsegs for its sake frees nothing
                continue
            need -= seg.held  # settles: by itself, or once the open vseg it waits in closes
            if close_waiting(seg):
                closed.append(seg.vlog)
        return closed

    def free(self, seg) -> None:
        """``seg`` is gone for good (retention, deletion): its memory, if it still has any."""
        self.resident.pop(seg, None)
        self.release(seg.held)
        seg.held = 0
