"""MemoryBudget: the bound on what a broker's segments may take.

Segments are charged at their full capacity when allocated (an mmap costs
address space, and will cost pages as it fills); a stream's segments are
credited back when it leaves the broker. Past the budget, appends that need
a new segment are refused with a typed error instead of growing without
bound.
"""

from __future__ import annotations

from ..errors import BrokerFull


class MemoryBudget:
    def __init__(self, limit: int):
        self.limit = limit  # bytes; 0: no limit
        self.used = 0

    def reserve(self, n: int) -> None:
        if self.limit and self.used + n > self.limit:
            raise BrokerFull(f"broker memory budget of {self.limit} bytes is spent "
                             f"({self.used} in segments); no new segment")
        self.used += n

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)
