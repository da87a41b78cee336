"""Placement: which live broker serves a streamlet, and telling it so.

A new streamlet goes to the least loaded live broker (the streamlets its incarnation
owns, counted by the holdings index: nothing walks every stream); a stream's streamlets
and a recovery's are spread the same way. ``assign`` tells a broker what it now owns,
in as few requests as a frame allows (``kera.limits.MAX_BATCH_STREAMS`` and
``MAX_BATCH_STREAMLETS`` per request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .. import limits
from ..errors import KeraError, NotEnoughBackups
from ..stream_meta import StreamMeta
from .membership import Member, Roster
from .metadata import Metadata

log = logging.getLogger("kera.coordinator")


def batches(entries: list) -> list[list]:
    """[[stream, streamlets], ...] cut into parts that each fit one request's meta."""
    parts: list[list] = [[]]
    streamlets = 0
    for entry in entries:
        n = len(entry[1])
        if parts[-1] and (len(parts[-1]) == limits.MAX_BATCH_STREAMS
                          or streamlets + n > limits.MAX_BATCH_STREAMLETS):
            parts.append([])
            streamlets = 0
        parts[-1].append(entry)
        streamlets += n
    return parts


class Placement:
    """Owners for new streamlets among the ``roster``'s live brokers, by the ``metadata``'s
    holdings; ``pool()``: the coordinator's pool."""

    def __init__(self, roster: Roster, metadata: Metadata, pool: Callable):
        self.roster, self.metadata, self.pool = roster, metadata, pool

    def loads(self) -> tuple[list[Member], dict[int, int]]:
        """The live brokers and the streamlets each one's incarnation owns."""
        brokers = sorted(self.roster.live("broker"), key=lambda m: m.id)
        if not brokers:
            raise NotEnoughBackups("no live broker")
        holdings = self.metadata.holdings
        return brokers, {m.id: holdings.count((m.id, m.epoch)) for m in brokers}

    def spread(self, n: int, salt: int = 0, loads: tuple | None = None) -> list[Member]:
        """n owners among live brokers, each time the least loaded (streamlets its
        incarnation owns). ``loads``: those of ``loads()``, counted on by each call (a batch of
        creates takes them once, not once per stream)."""
        brokers, load = loads or self.loads()
        out = []
        for _i in range(n):
            m = min(brokers, key=lambda m: (load[m.id], (m.id + salt) % len(brokers)))
            load[m.id] += 1
            out.append(m)
        return out

    async def assign(self, m: Member, entries: list, recovering: bool = False, seal: bool = False,
                     held_since: int | None = None) -> None:
        """Tell ``m`` it owns ``entries`` ([[StreamMeta, [streamlet, ...]], ...]), in as few
        requests as a frame allows. ``seal``: the recovery of these streamlets lost data; their
        groups are closed. ``held_since``: ``m`` was given these streams' maps when the
        catalog's ``alters`` was this (a recovery's hand-over): those not altered since are
        named by id, not sent again (a third of a million maps per broker after a
        whole-cluster restart)."""
        backups = self.roster.tell_backups(m)
        altered = self.metadata.streams.altered_since
        for part in batches(entries):
            meta = {"epoch": m.epoch, "recovering": recovering, "seal": seal, "backups": backups}
            if held_since is not None:
                meta["ids"] = [[s.id, sl] for s, sl in part if not altered(s.name, held_since)]
                part = [e for e in part if altered(e[0].name, held_since)]
            if part:
                maps = self.metadata.wires([s for s, _ in part])
                meta["streams"] = [[d, sl] for d, (_, sl) in zip(maps, part, strict=True)]
            await self.pool().call(m.addr, "assign", meta, timeout=10)

    async def assign_owners(self, streams: list[StreamMeta]) -> None:
        """Tell each owner broker about its streamlets of ``streams``: one request per broker,
        all in parallel."""
        by_broker: dict[tuple, list] = {}
        for s in streams:
            mine: dict[tuple, list[int]] = {}
            for i, (b, e) in enumerate(s.owners):
                mine.setdefault((b, e), []).append(i)
            for key, sl in mine.items():
                by_broker.setdefault(key, []).append([s, sl])

        async def one(bid, epoch, entries):
            m = self.roster.live_broker(bid, epoch)
            if m is None:
                return
            try:
                await self.assign(m, entries)
            except KeraError as e:
                log.warning("assigning %d streams to broker %d failed: %s", len(entries), bid, e)

        async with trio.open_nursery() as n:
            for (bid, epoch), entries in by_broker.items():
                n.start_soon(one, bid, epoch, entries)
