"""Consumers: one pull per broker covering all its streamlets, chunks out.

A position in a streamlet is ``{"low": g, "groups": {group: pos}}``: groups
below ``low`` are read to their end, a group absent from ``groups`` is read
from its start, and ``pos`` packs (segment << 32 | offset), or -1 once a
closed group was read to its end. Positions are what the broker wrote in the
chunk headers, so they stay valid when a streamlet is recovered elsewhere.

A consumer in a ``group`` starts where the group's committed positions say, and
``commit`` stores its current ones, both through the internal positions stream
(``kera_client.positions``).

Retention frees old segments: a position before what a broker still holds
is answered ``out_of_range``, and ``auto_offset_reset`` (Kafka's
``auto.offset.reset``) says what then: ``earliest`` (default) moves the
groups concerned to their first retained position (a group freed entirely
is skipped), ``latest`` to the durable end, ``none`` raises ``OutOfRange``.
``resets`` counts how often it happened.

A consumer may read a million streams. It pulls in one session per broker
(``kera.broker.pull_sessions``): its streamlets there are named once (a few
requests of up to ``MAX_PULL_STREAMLETS``), then each pull carries only the
positions that moved, and the broker answers from the streamlets that have
something new. Metadata comes a page at a time (``metadata``); a pattern's new
streams are found by asking for those created since the last look, and only
the streams whose owner refused or did not answer are looked up again. So
nothing per poll walks every stream.
"""

from __future__ import annotations

import time
from collections import namedtuple
from contextlib import asynccontextmanager

import trio

from kera import chunk as chunkfmt
from kera.coordinator.link import CoordinatorLink
from kera.errors import KeraError, OutOfRange, Unauthorized, Unavailable, UnknownSession
from kera.limits import MAX_PULL_STREAMLETS
from kera.position import DONE, pack
from kera.rpc import open_pool, unwrapped
from kera.security.client_config import credentials

from .admin import default_coordinator, suspect
from .metadata import describe, fetch
from .portal import Synced
from .stream_view import StreamView

Record = namedtuple("Record", "stream streamlet key value timestamp")


class Chunk:
    """A chunk as received: where it came from, and zero-copy access to its records.

    ``skip``: how many of its first records its consumer group had already consumed
    (a group may stop in the middle of a chunk); they are left out of ``len``,
    ``values``, ``keys`` and ``records``."""

    __slots__ = ("stream", "streamlet", "group", "position", "view", "skip")

    def __init__(self, stream, streamlet, group, position, view, skip: int = 0):
        self.stream, self.streamlet, self.group, self.position, self.view = \
            stream, streamlet, group, position, view
        self.skip = skip

    def __len__(self):
        return len(self.view) - self.skip

    @property
    def producer(self) -> int:
        return self.view.header.producer_id

    @property
    def sequence(self) -> int:
        return self.view.header.sequence

    def values(self) -> list[bytes]:
        v = self.view.values()
        return v[self.skip:] if self.skip else v

    def keys(self) -> list[bytes | None]:
        return self.view.keys()[self.skip:]

    def records(self):
        for n, (k, v, t) in enumerate(self.view.records()):
            if n >= self.skip:
                yield Record(self.stream, self.streamlet, k, v, t)


class _Link:
    """Our pull session with one broker: its id (0: none yet), the streamlets it reads, the
    positions to tell it (named first, or moved since the last pull) and those it drops."""

    __slots__ = ("addr", "session", "members", "todo", "drops")

    def __init__(self, addr: str):
        self.addr = addr
        self.session = 0
        self.members: set[tuple] = set()
        self.todo: dict[tuple, None] = {}
        self.drops: list = []


def _compact(p: dict) -> None:
    g = p["groups"]
    while g.get(p["low"]) == DONE:
        del g[p["low"]]
        p["low"] += 1


class AsyncConsumer:
    def __init__(self, pool, coordinator: str, streams=None, pattern: str | None = None,
                 start="earliest", group: str | None = None, max_bytes: int = 8 << 20,
                 max_wait_ms: int = 200, auto_offset_reset: str = "earliest",
                 streamlets: list[int] | None = None, positions=None):
        """``streamlets``: read only these streamlets of each stream (default: all).
        ``positions``: a ``GroupPositions`` shared with other consumers of the process
        (their commits then leave together); default: one of its own, on first use."""
        if not streams and not pattern:
            raise ValueError("give streams or a pattern")
        if auto_offset_reset not in ("earliest", "latest", "none"):
            raise ValueError("auto_offset_reset must be earliest, latest or none")
        self.auto_offset_reset = auto_offset_reset
        self.resets = 0
        self._refused: KeraError | None = None   # raised by the next poll
        self.pool = pool
        self.coordinator = CoordinatorLink(pool, coordinator)
        self.names = list(streams or [])
        self.pattern = pattern
        self.start = start
        self.group = group
        self.only = streamlets
        self._committer = positions
        self.max_bytes = max_bytes
        self.max_wait_ms = max_wait_ms
        self.streams: dict[str, StreamView] = {}
        self.by_id: dict[int, StreamView] = {}
        self.positions: dict[tuple, dict] = {}  # (name, streamlet) -> position
        self.records_read = 0
        self._meta_at = 0.0
        self._skips: dict[tuple, tuple[int, int]] = {}   # (name, streamlet, group) -> (pos, records)
        self._links: dict[str, _Link] = {}      # broker address -> our pull session there
        self._where: dict[tuple, _Link] = {}    # (name, streamlet) -> the session reading it
        self._unplaced: dict[tuple, None] = {}  # no live owner known, or it refused: look up again
        self._looked_at = 0.0
        self._top: int | None = None            # the newest stream id a pattern was matched to
        self._dirty: set[tuple] = set()         # positions moved since the last commit

    async def _metadata(self) -> None:
        """Every stream named or matching the pattern, a page at a time: new ones start at
        their starting position, moved ones are read from their new owners."""
        self._meta_at = time.monotonic()
        tops: list = []
        got = await describe(self.coordinator, self.names, self.pattern, tops=tops)
        top = tops[0]
        self._top = top if self._top is None or top is None else max(self._top, top)
        await self._learn(got.values())

    async def _discover(self) -> None:
        """A pattern's streams created since the last look (not every name again)."""
        self._meta_at = time.monotonic()
        if self._top is None:   # an older coordinator: the whole listing
            await self._metadata()
            return
        got: list[StreamView] = []
        top = await fetch(self.coordinator, (), self.pattern,
                          lambda cols, _: got.extend(cols.views(StreamView)),
                          since=self._top)
        if top is not None:
            self._top = max(self._top, top)
        await self._learn(got)

    async def _learn(self, views) -> None:
        """Streams as the coordinator describes them now: new ones get positions, and every
        streamlet whose owner changed (or that waits for one) is placed on its owner."""
        new, moved = [], []
        for v in views:
            old = self.streams.get(v.name)
            if old is not None and old.id != v.id:   # re-created: a new stream under the name
                self.by_id.pop(old.id, None)
                old = None
            self.streams[v.name] = v
            self.by_id[v.id] = v
            if old is None:
                new.append(v)
            elif old.addrs != v.addrs:
                moved.append(v)
        if new:
            await self._init_positions(new)
        for v in moved:
            for i in self._mine(v):
                key = (v.name, i)
                link = self._where.get(key)
                if key in self.positions and (link is None or link.addr != v.addrs[i]):
                    self._place(key)

    def _mine(self, s: StreamView):
        return range(s.streamlets) if self.only is None else [i for i in self.only if i < s.streamlets]

    async def _look_again(self) -> None:
        """The streams of the streamlets waiting for an owner, looked up again (at most once
        every 0.2 s); those deleted meanwhile are no longer read."""
        if not self._unplaced or time.monotonic() - self._looked_at < 0.2:
            return
        self._looked_at = time.monotonic()
        keys = list(self._unplaced)
        names = sorted({n for n, _ in keys})
        try:
            got = await describe(self.coordinator, names, strict=False)
        except KeraError:
            return
        for n in names:
            v = got.get(n)
            if v is None or v.id != self.streams[n].id:   # deleted (or re-created)
                self._forget(n)
        await self._learn(got.values())
        for key in keys:
            if key in self._unplaced and key in self.positions:
                self._place(key)

    def _forget(self, name: str) -> None:
        s = self.streams.pop(name, None)
        if s is None:
            return
        self.by_id.pop(s.id, None)
        for i in range(s.streamlets):
            key = (name, i)
            self._unplace(key)
            self._unplaced.pop(key, None)
            self.positions.pop(key, None)

    # -- sessions: which broker reads which streamlet ------------------------------------------
    def _place(self, key: tuple) -> None:
        """Read ``key`` from its owner (its position goes in the next pull there)."""
        addr = self.streams[key[0]].addrs[key[1]]
        old = self._where.get(key)
        if old is not None and old.addr != addr:
            self._unplace(key)
            old = None
        if addr is None:
            self._unplaced[key] = None
            return
        self._unplaced.pop(key, None)
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = _Link(addr)
        self._where[key] = link
        link.members.add(key)
        link.todo[key] = None

    def _unplace(self, key: tuple) -> None:
        link = self._where.pop(key, None)
        if link is not None:
            link.members.discard(key)
            link.todo.pop(key, None)
            s = self.streams.get(key[0])
            if s is not None and link.session:
                link.drops.append([s.id, key[1]])

    def _moved(self, key: tuple) -> None:
        """``key``'s position changed here: its session hears of it, the next commit too."""
        if self.group:
            self._dirty.add(key)
        link = self._where.get(key)
        if link is not None:
            link.todo[key] = None

    async def _init_positions(self, streams) -> None:
        saved = await self._positions().fetch(self.group, {s.name: s.id for s in streams}) \
            if self.group else {}
        latest = []
        for s in streams:
            for i in self._mine(s):
                key = f"{s.name}/{i}"
                if isinstance(self.start, dict) and (s.name, i) in self.start:
                    self.positions[(s.name, i)] = _copy(self.start[(s.name, i)])
                elif key in saved:
                    p = saved[key]
                    self.positions[(s.name, i)] = {"low": p["low"],
                                                   "groups": {int(g): v for g, v in p["groups"].items()}}
                    for g, (pos, k) in (p.get("skip") or {}).items():
                        self._skips[(s.name, i, int(g))] = (pos, k)
                elif self.start == "latest":
                    latest.append((s, i))
                else:
                    self.positions[(s.name, i)] = {"low": 0, "groups": {}}
        if latest:
            by_addr: dict[str, list] = {}
            for s, i in latest:
                if s.addrs[i] is None:  # being recovered: its end is not known yet
                    raise Unavailable(f"stream {s.name} streamlet {i} has no live owner; "
                                      f"its latest position is not known yet")
                by_addr.setdefault(s.addrs[i], []).append([s.id, i])
            for addr, sls in by_addr.items():
                for k in range(0, len(sls), MAX_PULL_STREAMLETS):
                    r, _ = await self.pool.call(addr, "offsets", {"streamlets": sls[k:k + MAX_PULL_STREAMLETS]},
                                                timeout=30)
                    for sid, i, low, pos in r["offsets"]:
                        self.positions[(self.by_id[sid].name, i)] = {"low": low, "groups": dict(pos)}
        for s in streams:
            for i in self._mine(s):
                key = (s.name, i)
                if key in self.positions:
                    if self.group and f"{s.name}/{i}" not in saved:
                        self._dirty.add(key)   # not the group's yet: the next commit stores it
                    self._place(key)

    def position(self) -> dict:
        """Current positions, JSON-friendly: ``{"stream/streamlet": {"low", "groups"}}``, with
        ``"skip": {group: [pos, records]}`` where the group stopped inside a chunk."""
        return {f"{n}/{i}": self._position_of((n, i)) for n, i in self.positions}

    def _position_of(self, key: tuple) -> dict:
        p = self.positions[key]
        e = {"low": p["low"], "groups": {str(g): v for g, v in p["groups"].items()}}
        if self._skips:
            skip = {str(g): list(v) for (n2, i2, g), v in self._skips.items() if (n2, i2) == key}
            if skip:
                e["skip"] = skip
        return e

    def rewind(self, unconsumed: list[Chunk], taken: int = 0) -> None:
        """Step back before chunks polled but not consumed (in poll order), the first of
        them ``taken`` records in: what a group commits next resumes exactly there."""
        first: dict[tuple, Chunk] = {}
        for ch in unconsumed:
            first.setdefault((ch.stream, ch.streamlet, ch.group), ch)
        if unconsumed and taken:
            ch = unconsumed[0]
            self._skips[(ch.stream, ch.streamlet, ch.group)] = (ch.position,
                                                                 chunkfmt.skip_out(ch.view, ch.skip + taken))
        for (name, i, gid), ch in sorted(first.items(), key=lambda kv: kv[0][2]):
            self._moved((name, i))
            p = self.positions[(name, i)]
            if gid < p["low"]:   # the group (and those after it) were read to their end
                for g in range(gid + 1, p["low"]):
                    p["groups"].setdefault(g, DONE)
                p["low"] = gid
            p["groups"][gid] = ch.position
            if not (unconsumed and taken and ch is unconsumed[0]) and ch.skip:
                self._skips[(name, i, gid)] = (ch.position, chunkfmt.skip_out(ch.view, ch.skip))

    def _positions(self):
        if not self.group:
            raise ValueError("committed positions need a consumer group name")
        if self._committer is None:
            from .positions import GroupPositions  # it reads with consumers of its own
            self._committer = GroupPositions(self.pool, self.coordinator.addrs)
        return self._committer

    async def commit(self) -> None:
        """Store the current positions as the group's (those moved since the last commit: the
        others are stored already); returns once they are durable."""
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

    async def poll_chunks(self, timeout: float = 1.0) -> list[Chunk]:
        """Chunks after the current positions, from every broker at once (zero-copy views)."""
        if not self.streams:
            await self._metadata()
        elif self.pattern and time.monotonic() - self._meta_at > 1.0:
            await self._discover()  # with a pattern: new matching streams join, once a second
        deadline = trio.current_time() + timeout
        while True:
            await self._look_again()
            out: list[Chunk] = []
            wait = max(0, int((deadline - trio.current_time()) * 1000))
            links = [link for link in self._links.values() if link.members or link.drops]
            async with trio.open_nursery() as n:
                for link in links:
                    n.start_soon(self._pull, link, wait, out)
            if self._refused is not None:  # auto_offset_reset='none', or an ACL
                err, self._refused = self._refused, None
                raise err
            if out or trio.current_time() >= deadline:
                return out
            if self._unplaced or not links:
                await trio.sleep(min(0.05, max(0.0, deadline - trio.current_time())))

    async def _pull(self, link: _Link, wait: int, out: list) -> None:
        """One pull in ``link``'s session: the positions moved since the last one (and the
        streamlets left), then what the broker has that is new."""
        add, units = [], 0
        while link.todo and units < MAX_PULL_STREAMLETS - 64:
            key, _ = link.todo.popitem()
            p = self.positions[key]
            add.append([self.streams[key[0]].id, key[1], p["low"], p["groups"]])
            units += 1 + len(p["groups"]) // 8
        drops, link.drops = link.drops[:MAX_PULL_STREAMLETS], link.drops[MAX_PULL_STREAMLETS:]
        meta = {"session": link.session, "add": add, "drop": drops, "max_bytes": self.max_bytes,
                "max_wait_ms": 0 if link.todo else min(wait, self.max_wait_ms)}
        try:
            r, payload = await self.pool.call(link.addr, "pull", meta, timeout=wait / 1000 + 30)
        except KeraError as e:
            self._requeue(link, add)
            if e.code == UnknownSession.code:   # it restarted, or forgot us: name them all again
                link.session = 0
                link.drops = []
                for key in link.members:
                    link.todo[key] = None
                return
            self.pool.drop(link.addr)
            if e.code == "unavailable":
                await suspect(self.coordinator, link.addr)
            for key in list(link.members):   # who owns them now? (once per failure, not per poll)
                self._unplace(key)
                self._unplaced[key] = None
            self._links.pop(link.addr, None)
            return
        link.session = r["session"]
        for e in r["errors"]:
            s = self.by_id.get(e[0])
            key = (s.name, e[1]) if s is not None else None
            if key is None or key not in self.positions:
                continue
            if len(e) > 3 and e[2] == OutOfRange.code:
                await self._reset(e[0], e[1], e[3])
                link.todo[key] = None   # it left the session: named again, from where it goes on
            elif e[2] == Unauthorized.code:   # it left the session; the next poll raises
                self._refused = Unauthorized(f"may not read stream {s.name}")
            elif self._where.get(key) is link:   # not owned there, recovering: who owns it now?
                self._where.pop(key)
                link.members.discard(key)
                link.todo.pop(key, None)
                self._unplaced[key] = None
        self._absorb(r["entries"], payload, out, link)

    def _requeue(self, link: _Link, add: list) -> None:
        for sid, i, *_ in add:
            s = self.by_id.get(sid)
            if s is not None and self._where.get((s.name, i)) is link:
                link.todo[(s.name, i)] = None

    async def _reset(self, sid: int, i: int, starts: dict) -> None:
        """Our position in a streamlet was freed by retention (``auto_offset_reset``)."""
        s = self.by_id.get(sid)
        if s is None:
            return
        p = self.positions[(s.name, i)]
        if self.group:
            self._dirty.add((s.name, i))
        if self.auto_offset_reset == "none":
            self._refused = OutOfRange(f"stream {s.name} streamlet {i}: position {p} is "
                                            f"before the retained data")
            return
        self.resets += 1
        if self.auto_offset_reset == "latest":
            r, _ = await self.pool.call(s.addrs[i], "offsets", {"streamlets": [[sid, i]]}, timeout=30)
            for _, _, low, pos in r["offsets"]:
                self.positions[(s.name, i)] = {"low": low, "groups": dict(pos)}
            return
        held = {int(g): v for g, v in starts["groups"].items()}
        for g, v in list(p["groups"].items()):
            if v == DONE:
                continue
            if g not in held:
                p["groups"][g] = DONE  # freed entirely
            elif v < held[g]:
                p["groups"][g] = held[g]
        _compact(p)

    def _absorb(self, entries, payload, out, link: _Link | None = None) -> None:
        at = 0
        dirty = self._dirty if self.group else None   # only a group commits
        for sid, i, gid, _seg, _off, n, nxt in entries:
            s = self.by_id.get(sid)
            key = (s.name, i) if s is not None else None
            p = self.positions.get(key)
            if p is None:
                at += n
                continue
            if dirty is not None:
                dirty.add(key)
            if link is not None:
                link.todo[key] = None
            if n:
                buf = payload[at:at + n]
                at += n
                for h, o in chunkfmt.scan(buf):
                    # a chunk's position is its placement (a compacted segment's chunks are
                    # not back to back in the original offsets)
                    pos = pack(h.segment, h.offset)
                    view = chunkfmt.ChunkView(buf, o, h)
                    skip = 0
                    sk = self._skips.get((s.name, i, gid))
                    if sk is not None and sk[0] == pos:
                        skip = chunkfmt.skip_in(view, sk[1])
                        del self._skips[(s.name, i, gid)]
                    if skip < h.record_count:
                        out.append(Chunk(s.name, i, gid, pos, view, skip))
                    self.records_read += h.record_count - skip
            p["groups"][gid] = nxt
            _compact(p)

    async def poll(self, timeout: float = 1.0) -> list[Record]:
        out = []
        for c in await self.poll_chunks(timeout):
            out.extend(c.records())
        return out


def _copy(p):
    return {"low": p["low"], "groups": dict(p["groups"])}


@asynccontextmanager
async def open_consumer(streams=None, coordinator: str | None = None, config: dict | None = None,
                        **kw):
    """``async with open_consumer(["s"], start="earliest") as c: chunks = await c.poll_chunks()``;
    ``config``: the security settings (``kera.security.client_config``; default ``KERA_CONFIG``)."""
    async with unwrapped(), open_pool(credentials=credentials(config)) as pool:
        c = AsyncConsumer(pool, coordinator or default_coordinator(), streams, **kw)
        await c._metadata()
        yield c


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

