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
from kera.coordinator_link import CoordinatorLink
from kera.limits import MAX_CHUNK

from .streamlet_log import StreamletLog


class GroupPositions:
    """Commits and fetches of consumer-group positions, for one process or consumer."""

    def __init__(self, pool, coordinator: str, timeout: float = 30.0):
        self.pool, self.coordinator, self.timeout = pool, coordinator, timeout
        self.stream: dict | None = None
        self.logs: dict[int, StreamletLog] = {}
        self.latest: dict[int, dict[bytes, bytes]] = {}   # streamlet -> key -> latest value
        self._lock = trio.Lock()   # a streamlet log appends one chunk at a time

    async def _log(self, group: str) -> tuple[StreamletLog, int]:
        if self.stream is None:
            r, _ = await CoordinatorLink(self.pool, self.coordinator).call(
                "positions_stream", {}, timeout=self.timeout)
            self.stream = r["stream"]
        i = gp.streamlet_of(gp.check_group(group), self.stream["streamlets"])
        log = self.logs.get(i)
        if log is None:
            log = StreamletLog(self.pool, self.coordinator, gp.NAME, i, self.timeout)
            await log.open()
            self.logs[i], self.latest[i] = log, {}
        return log, i

    async def commit(self, group: str, positions: dict, ids: dict[str, int]) -> None:
        """Store ``positions`` (``{"stream/streamlet": position}``, streams named in ``ids``:
        name -> id) as ``group``'s; returns once they are durable."""
        keys, values = gp.encode(group, positions, ids)
        async with self._lock:
            log, _ = await self._log(group)
            room = chunkfmt.record_room(min(MAX_CHUNK, self.stream["segment_size"]))
            start, size = 0, 0
            for j, (k, v) in enumerate(zip(keys, values, strict=True)):
                n = 16 + len(k) + len(v)
                if j > start and size + n > room:   # a group reading very many streams
                    await log.append("produce", {"acks": "all"}, values[start:j], keys[start:j])
                    start, size = j, 0
                size += n
            if keys:
                await log.append("produce", {"acks": "all"}, values[start:], keys[start:])

    async def fetch(self, group: str, ids: dict[str, int] | None = None) -> dict:
        """``group``'s latest committed positions (streams re-created since, per ``ids``,
        left out); every commit acknowledged before the call is seen."""
        async with self._lock:
            log, i = await self._log(group)
            latest = self.latest[i]

            def fold(ch):
                latest.update(zip(ch.keys(), ch.values(), strict=True))

            await log.sync(fold)
            return gp.decode(group, latest, ids)
