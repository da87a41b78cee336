"""Consumer-group positions kept in kera itself (``kera.group_positions``: the
internal stream, its records and why).

A commit appends one chunk, acks all, to the group's streamlet of
``__consumer_positions``: acknowledged once it is on R copies, so it survives
what any acknowledged record survives (broker kills, recovery, a restart of
the whole cluster), and the coordinator never handles it. A fetch reads that
one streamlet up to its tail and keeps the latest value per key; the values
read so far are cached, so the next fetch reads only what was appended since.
"""

from __future__ import annotations

import trio

from kera import chunk as chunkfmt
from kera import group_positions as gp
from kera.coordinator.link import CoordinatorLink
from kera.limits import MAX_CHUNK

from .stream_view import StreamView
from .streamlet_log import StreamletLog


class _Streamlet:
    """One streamlet of the positions stream as this process sees it."""

    def __init__(self, log: StreamletLog):
        self.log = log
        self.latest: dict[bytes, bytes] = {}   # key -> latest value read
        self.reading = trio.Lock()
        self.writing = trio.Lock()             # one append at a time (a writer's sequence)
        self.open: _Batch | None = None        # commits waiting for the next append


class _Batch:
    def __init__(self):
        self.keys: list[bytes] = []
        self.values: list[bytes] = []
        self.done = False


class GroupPositions:
    """Commits and fetches of consumer-group positions. One may serve many consumers of a
    process: their commits to the same streamlet that wait while one is appended leave
    together in the next chunk (group commit), one request for all of them."""

    def __init__(self, pool, coordinator, timeout: float = 30.0):
        self.pool, self.coordinator, self.timeout = pool, coordinator, timeout
        self.stream: StreamView | None = None
        self.streamlets: dict[int, _Streamlet] = {}
        self._opening = trio.Lock()

    async def _streamlet(self, group: str) -> _Streamlet:
        gp.check_group(group)
        async with self._opening:
            if self.stream is None:
                r, _ = await CoordinatorLink(self.pool, self.coordinator).call(
                    "positions_stream", {}, timeout=self.timeout)
                self.stream = StreamView.from_wire(r["stream"])
            i = gp.streamlet_of(group, self.stream.streamlets)
            sl = self.streamlets.get(i)
            if sl is None:
                log = StreamletLog(self.pool, self.coordinator, gp.NAME, i, self.timeout)
                await log.open()
                sl = self.streamlets[i] = _Streamlet(log)
            return sl

    async def commit(self, group: str, positions: dict, ids: dict[str, int]) -> None:
        """Store ``positions`` (``{"stream/streamlet": position}``, streams named in ``ids``:
        name -> id) as ``group``'s; returns once they are durable."""
        keys, values = gp.encode(group, positions, ids)
        if not keys:
            return
        sl = await self._streamlet(group)
        batch = sl.open
        if batch is None:
            batch = sl.open = _Batch()
        batch.keys += keys
        batch.values += values
        async with sl.writing:
            if not batch.done:   # else an earlier holder appended it, ours with it
                if sl.open is batch:
                    sl.open = None
                # on failure the next holder (first in line) appends it again
                await self._append(sl.log, batch.keys, batch.values)
                batch.done = True

    async def _append(self, log: StreamletLog, keys: list[bytes], values: list[bytes]) -> None:
        """In chunks that fit the stream (one, unless the records are very many)."""
        room = chunkfmt.record_room(min(MAX_CHUNK, self.stream.segment_size))
        start, size = 0, 0
        for j, (k, v) in enumerate(zip(keys, values, strict=True)):
            n = 16 + len(k) + len(v)
            if j > start and size + n > room:
                await log.append("produce", {"acks": "all"}, values[start:j], keys[start:j])
                start, size = j, 0
            size += n
        await log.append("produce", {"acks": "all"}, values[start:], keys[start:])

    async def fetch(self, group: str, ids: dict[str, int] | None = None) -> dict:
        """``group``'s latest committed positions (with ``ids``, name -> id: of those streams
        only, as they are now); every commit acknowledged before the call is seen."""
        sl = await self._streamlet(group)
        async with sl.reading:
            def fold(ch):
                sl.latest.update(zip(ch.keys(), ch.values(), strict=True))

            await sl.log.sync(fold)
            return gp.decode(group, sl.latest, ids)
