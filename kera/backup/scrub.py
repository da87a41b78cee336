"""Scrubbing: every chunk on disk is read back and verified again, at a bounded rate.

A disk rots without a word: a chunk that turned bad in a file no one reads is found
only when it is needed, which for evicted data may be when its other copy is gone.
The scrubber walks this backup's replicas in key order, reading the part of each file
that is written (below ``flushed``) in pieces of at most ``PIECE`` bytes, in a worker
thread, verifying every chunk (``disk.read_verified``). A chunk that fails is marked
corrupt on its replica, as any read marks it (``ReadBack.corrupt``): never served
again, listed as corrupt, and counted in ``damage``, which the backup's heartbeats
carry, so each broker asks this backup what it holds and makes a copy it finds damaged
again elsewhere (``kera.broker.rebuild``).

The rate (``--scrub-rate`` bytes per second) bounds the disk and CPU it takes beside
the service; a pass starts at most every ``--scrub-every`` seconds, so a small data
set is not read over and over. Replicas made or dropped during a pass are taken as
they come: a dropped one is skipped (``ReadBack.read_replica`` refuses it).
"""

from __future__ import annotations

import logging
from bisect import bisect_left, bisect_right

import trio

from ..errors import BackupError
from . import disk
from .readback import ReadBack
from .store import BackupStore

log = logging.getLogger("kera.backup")

PIECE = 1 << 20           # bytes read and verified at once
DEFAULT_RATE = 4 << 20    # bytes per second
DEFAULT_EVERY = 600.0     # seconds between the starts of two passes


class Scrubber:
    """Reads back every replica's written bytes at ``rate`` bytes per second, a pass at most
    every ``every`` seconds; handed the ``store``, the service's ``counters`` and its reads
    (``readback``: a replica's file read, a corrupt chunk marked)."""

    def __init__(self, store: BackupStore, counters: dict, readback: ReadBack, *,
                 rate: int = DEFAULT_RATE, every: float = DEFAULT_EVERY):
        self.store, self.counters, self.readback = store, counters, readback
        self.rate, self.every = rate, every

    async def run(self) -> None:
        """A pass every ``scrub_every`` seconds, the first one that long after the start
        (what a restart reloads is checked by the reload itself)."""
        next_at = trio.current_time() + self.every
        while True:
            await trio.sleep_until(next_at)
            next_at = trio.current_time() + self.every
            await self.scrub_pass()

    async def scrub_pass(self) -> int:
        """One walk over every replica's written bytes; returns the corrupt chunks it found."""
        found = 0
        for key in sorted(self.store.replicas):
            rep = self.store.replicas.get(key)
            if rep is None:
                continue
            try:
                found += await self._scrub(rep)
            except BackupError as e:   # dropped meanwhile, or an I/O error (logged, next one)
                if not rep.dropped:
                    log.warning("scrubbing replica %s: %s", rep.key, e)
        self.counters["scrub_passes"] += 1
        return found

    async def _scrub(self, rep) -> int:
        found, off = 0, 0
        while True:
            # the chunks written to the file from ``off``, up to PIECE bytes (one at least)
            upto = rep.flushed
            i = bisect_left(rep.starts, off)
            if i >= len(rep.starts) or rep.ends[i] > upto:
                return found
            j = max(bisect_right(rep.ends, min(upto, rep.starts[i] + PIECE)), i + 1)
            starts, ends = rep.starts[i:j].tolist(), rep.ends[i:j].tolist()
            start, stop = starts[0], ends[-1]
            _, bad = await self.readback.read_replica(rep, disk.read_verified, rep.path, start, stop,
                                                      starts, ends)
            self.counters["scrubbed_bytes"] += stop - start
            if bad is not None:
                o, size, _ = self.readback.corrupt(rep, bad)
                found += 1
                stop = o + size
            off = stop
            await trio.sleep((stop - start) / self.rate)
