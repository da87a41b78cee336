"""Consumer groups' committed positions and lag, without a consumer running.

The leading coordinator, when it serves metrics, reads the positions stream
(``kera.group_positions``) every ``interval`` seconds, as a group's consumer
would when it starts (read to the tail, only what was appended since the last
round), then asks each owning broker how far
the committed positions are behind the durable end (``lag`` RPC: a bisection
per segment held, nothing per record). Records are counted from the chunk
headers as they were appended; for segments adopted from a recovery's index
the broker estimates them from its bytes per record.

Series are per (group, stream), the ``top`` with the most lag: a cluster with
many groups reading many streams keeps a bounded number of series.

The reader of the positions stream is the client's (``kera_client.streamlet_log``), handed
in by whoever composes the coordinator's process (``kera.cli``): a server module never
imports the client, which stands above it (it calls the coordinator through
``kera.coordinator.link``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import msgpack
import trio

from .. import group_positions as gp
from ..errors import KeraError

log = logging.getLogger("kera.metrics.lag")

CALL_TIMEOUT = 5.0


class PositionsLog(Protocol):
    """One streamlet of the positions stream, read to its durable end by each ``sync``."""

    async def open(self) -> None: ...

    async def sync(self, fold: Callable[[object], None]) -> object: ...


# (pool, coordinator address, stream, streamlet, timeout) -> its reader
OpenLog = Callable[..., PositionsLog]


class GroupLag:
    def __init__(self, coord, interval: float, top: int, open_log: OpenLog):
        self.coord, self.interval, self.top = coord, interval, top
        self.open_log = open_log
        self.logs: dict[int, tuple] = {}    # streamlet of the positions stream -> (log, latest)
        self.rows: list[tuple] = []          # (group, stream, lag, lag bytes, position records)
        self.groups = 0
        self.rounds = self.failures = 0

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            if not self.coord.leading or gp.NAME not in self.coord.metadata.streams:
                self.rows, self.groups = [], 0   # a standby shows no lag (the leader does)
                continue
            with trio.move_on_after(max(10.0, 2 * self.interval)):
                try:
                    await self.round()
                    self.rounds += 1
                except (KeraError, OSError) as e:
                    self.failures += 1
                    log.info("consumer lag round failed: %s", e)

    async def round(self) -> None:
        c = self.coord
        streams = c.metadata.streams
        ps = streams[gp.NAME]
        commits: dict[tuple[str, str], dict] = {}
        for i in range(ps.streamlets):
            got = self.logs.get(i)
            if got is None or got[2] != ps.id:
                log_ = self.open_log(c.pool, c.addr, gp.NAME, i, CALL_TIMEOUT)
                await log_.open()
                got = self.logs[i] = (log_, {}, ps.id)
            latest = got[1]

            def fold(ch, latest=latest):
                latest.update(zip(ch.keys(), ch.values(), strict=True))
            await got[0].sync(fold)
            for key in latest:
                try:
                    group, name = msgpack.unpackb(key)
                except (ValueError, TypeError, msgpack.UnpackException):
                    continue
                s = streams.get(name) if isinstance(name, str) else None
                if s is None or not isinstance(group, str):
                    continue
                pos = gp.decode(group, {key: latest[key]}, {name: s.id})
                if pos:
                    commits[(group, name)] = pos
        # ask each owner about its streamlets: one request per broker
        asks: dict[int, list] = {}
        for (group, name), pos in commits.items():
            s = streams[name]
            for where, p in pos.items():
                i = int(where.rpartition("/")[2])
                if i < s.streamlets:
                    groups = {int(g): v for g, v in p["groups"].items()}
                    # a group stopped inside a chunk: its first ``n`` records were consumed
                    skip = sum(n for g, (at, n) in (p.get("skip") or {}).items()
                               if groups.get(int(g)) == at)
                    asks.setdefault(s.owners[i][0], []).append(
                        (group, name, [s.id, i, p["low"], groups], skip))
        totals: dict[tuple[str, str], list] = {k: [0, 0, 0] for k in commits}

        async def ask(bid: int, entries: list) -> None:
            m = c.roster.members["broker"].get(bid)
            if m is None or not m.alive:
                return
            r, _ = await c.pool.call(m.addr, "lag", {"positions": [e[2] for e in entries]},
                                     timeout=CALL_TIMEOUT)
            by = {(sid, i): (behind, nbytes, held) for sid, i, behind, nbytes, held in r["lag"]}
            for group, name, (sid, i, _, _), skip in entries:
                got = by.get((sid, i))
                if got is not None:
                    t = totals[(group, name)]
                    t[0] += got[0] - skip
                    t[1] += got[1]
                    t[2] += got[2] - got[0] + skip

        async with trio.open_nursery() as n:
            for bid, entries in asks.items():
                n.start_soon(ask, bid, entries)
        rows = sorted(((g, s, *t) for (g, s), t in totals.items()), key=lambda r: -r[2])
        self.groups = len({g for g, _ in commits})
        self.rows = rows[:self.top]

    def fill(self, f) -> None:
        f.gauge("consumergroup_lag", "Records after a group's committed position in a stream "
                "(the durable end minus it)", labels=["group", "stream"],
                samples=[((g, s), lag) for g, s, lag, _, _ in self.rows])
        f.gauge("consumergroup_lag_bytes", "Bytes of those records", labels=["group", "stream"],
                samples=[((g, s), b) for g, s, _, b, _ in self.rows])
        f.gauge("consumergroup_committed_records", "Records a group has consumed of those a "
                "stream still holds (its committed position, counted in records)",
                labels=["group", "stream"], samples=[((g, s), p) for g, s, _, _, p in self.rows])
        f.gauge("consumergroups", "Consumer groups with committed positions", self.groups)
        f.counter("consumergroup_lag_rounds", "Rounds of reading committed positions",
                  labels=["outcome"], samples=[(("ok",), self.rounds), (("failed",), self.failures)])
