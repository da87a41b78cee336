"""The servers' cyclic garbage collector: young collections, the rest frozen, a full one rarely.

Servers hold millions of long-lived objects (streams, segments, chunk refs) and
allocate freely per request. With CPython's default thresholds (700, 10, 10) a
request that allocates a few thousand objects can land on a full collection
that walks the whole heap (100-300 ms at 100,000 streams). Collecting the young
generation after 50,000 allocations keeps those collections few
(``GC_THRESHOLDS``, also the big client's: ``kera_client.bulk``).

What survives a young collection is, on a server, almost always what it
keeps: the streamlets, groups, segments and indexes of streams coming alive.
CPython then walks each such object a second time in the middle generation,
whose collections grew to 0.1-0.6 s each when many streams took their first
records (a fifth of a broker's CPU while 100,000 new streams each took a
record). So after every collection the survivors are frozen (``gc.freeze``,
O(1)): no later collection walks them, until the full collection that
``full_collections`` runs every ``FULL_EVERY`` young collections, as often
as CPython's own thresholds would have (10 young per middle, 500 middle per
full): it unfreezes everything and collects it all, so a cycle that became
garbage after it was frozen (a deleted stream's streamlet and its groups, a
closed connection's tasks) is reclaimed then, as a full collection would have.
Objects frozen are still freed by reference counting the moment they are
dropped: only cycles wait for the full collection.
"""

from __future__ import annotations

import gc
import logging
import time

import trio

GC_THRESHOLDS = (50_000, 10, 500)
FULL_EVERY = GC_THRESHOLDS[1] * GC_THRESHOLDS[2]   # collections between full ones
FULL_CHECK = 1.0     # seconds between looks at whether a full collection is due
PAUSE_LOG = 0.2      # seconds: a longer collection is logged

log = logging.getLogger("kera.gc")


class Collector:
    """The collector's callback (``gc.callbacks``): logs long pauses, freezes what each
    collection left, counts collections for ``full_collections``."""

    def __init__(self, freeze: bool = True):
        self.freeze = freeze
        self.started = 0.0
        self.since = 0        # collections since the last full one (nearly all young ones)
        self.full = 0         # full collections run by ``full_now``
        self.kept = 0         # objects frozen right after the last full one

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        if took > PAUSE_LOG:
            log.warning("collection of generation %d took %.2f s (%d freed)", info["generation"],
                        took, info["collected"])
        self.since += 1
        if self.freeze:
            gc.freeze()

    def due(self) -> bool:
        """CPython's own rule for a full collection: enough young collections, and the old
        objects grew by a quarter since the last one (else a stable heap is walked for
        nothing)."""
        return self.freeze and self.since >= FULL_EVERY and gc.get_freeze_count() > 1.25 * self.kept

    def full_now(self) -> None:
        """Everything frozen looked at again: a full collection (its survivors frozen again
        by the callback)."""
        self.since = 0
        self.full += 1
        gc.unfreeze()
        gc.collect()
        self.kept = gc.get_freeze_count()


def install(freeze: bool = True) -> Collector:
    """The servers' thresholds and callback (once per process)."""
    gc.set_threshold(*GC_THRESHOLDS)
    for cb in list(gc.callbacks):
        if isinstance(cb, Collector):
            gc.callbacks.remove(cb)
    c = Collector(freeze)
    gc.callbacks.append(c)
    return c


async def full_collections(c: Collector) -> None:
    """Runs the full collections that are due, between the loop's other work."""
    while True:
        await trio.sleep(FULL_CHECK)
        if c.due():
            c.full_now()
