"""Consumers: a ``Reader`` of many streams, in a consumer group if given one.

A consumer in a ``group`` starts where the group's committed positions say, and
``commit`` stores its current ones (those moved since the last commit), both
through the internal positions stream (``kera_client.positions``). Reading
itself (positions, pull sessions, chunks) is the ``reader``'s.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import trio

from kera.rpc import open_pool, unwrapped
from kera.security.client_config import credentials

from .admin import default_coordinator
from .portal import Synced
from .positions import GroupPositions
from .reader import Reader
from .received import Chunk, Record

__all__ = ["AsyncConsumer", "Chunk", "Consumer", "Record", "open_consumer"]


class AsyncConsumer(Reader):
    def __init__(self, pool, coordinator: str, streams=None, pattern: str | None = None,
                 start="earliest", group: str | None = None, max_bytes: int = 8 << 20,
                 max_wait_ms: int = 200, auto_offset_reset: str = "earliest",
                 streamlets: list[int] | None = None, positions: GroupPositions | None = None):
        """``streamlets``: read only these streamlets of each stream (default: all).
        ``positions``: a ``GroupPositions`` shared with other consumers of the process
        (their commits then leave together); default: one of its own, on first use."""
        super().__init__(pool, coordinator, streams, pattern, start, max_bytes, max_wait_ms,
                         auto_offset_reset, streamlets)
        self.group = group
        self._committer = positions
        if group:
            self._dirty = set()

    async def _saved(self, streams) -> dict:
        if not self.group:
            return {}
        return await self._positions().fetch(self.group, {s.name: s.id for s in streams})

    def _positions(self) -> GroupPositions:
        if not self.group:
            raise ValueError("committed positions need a consumer group name")
        if self._committer is None:
            self._committer = GroupPositions(self.pool, self.coordinator.addrs)
        return self._committer

    async def commit(self) -> None:
        """Store the current positions as the group's (those moved since the last commit: the
        others are stored already); returns once they are durable."""
        if not self.group:
            raise ValueError("committed positions need a consumer group name")
        moved, self._dirty = self._dirty, set()
        try:
            # a stream's streamlets are committed together (one record per stream)
            ids = {n: self.streams[n].id for n in {k[0] for k in moved} if n in self.streams}
            out = {f"{n}/{i}": self._position_of((n, i)) for n in ids for i in self._mine(self.streams[n])
                   if (n, i) in self.positions}
            await self._positions().commit(self.group, out, ids)
        except BaseException:
            self._dirty |= moved
            raise

    async def committed(self) -> dict:
        """The group's last committed positions of this consumer's streams (``position``'s shape)."""
        return await self._positions().fetch(self.group, {n: s.id for n, s in self.streams.items()})


@asynccontextmanager
async def open_consumer(streams=None, coordinator: str | None = None, config: dict | None = None,
                        **kw):
    """``async with open_consumer(["s"], start="earliest") as c: chunks = await c.poll_chunks()``;
    ``config``: the security settings (``kera.security.client_config``; default ``KERA_CONFIG``)."""
    async with unwrapped(), open_pool(credentials=credentials(config)) as pool, \
            trio.open_nursery() as n:
        c = AsyncConsumer(pool, coordinator or default_coordinator(), streams, **kw)
        await c.open(n)   # a pattern's listing goes on in ``n`` while the consumer reads
        try:
            yield c
        finally:
            n.cancel_scope.cancel()


class Consumer(Synced):
    """Synchronous consumer: ``for record in Consumer(["s"]).records(timeout=5): ...``."""

    def __init__(self, streams=None, coordinator: str | None = None, **kw):
        super().__init__("kera-consumer", open_consumer, streams, coordinator, **kw)
        self._c: AsyncConsumer = self._obj

    def poll_chunks(self, timeout: float = 1.0) -> list[Chunk]:
        return self.portal.call(self._c.poll_chunks, timeout)

    def poll(self, timeout: float = 1.0) -> list[Record]:
        return self.portal.call(self._c.poll, timeout)

    def records(self, timeout: float = 5.0, max_records: int | None = None):
        """Iterate records until ``timeout`` seconds pass with nothing new (or max_records)."""
        n = 0
        idle_since = time.monotonic()
        while max_records is None or n < max_records:
            got = self.poll(min(1.0, timeout))
            if got:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= timeout:
                return
            for r in got:
                yield r
                n += 1
                if max_records is not None and n >= max_records:
                    return

    def position(self) -> dict:
        return self._c.position()

    def commit(self) -> None:
        self.portal.call(self._c.commit)

    def committed(self) -> dict:
        return self.portal.call(self._c.committed)

