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
"""

from __future__ import annotations

import time
from collections import namedtuple
from contextlib import asynccontextmanager

import trio

from kera import chunk as chunkfmt
from kera.coordinator_link import CoordinatorLink
from kera.errors import KeraError, OutOfRange, Unauthorized, Unavailable, UnknownStream
from kera.position import DONE, pack
from kera.rpc import open_pool, unwrapped
from kera.security.client_config import credentials

from .admin import default_coordinator, suspect
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

    async def _metadata(self) -> None:
        self._meta_at = time.monotonic()
        r, _ = await self.coordinator.call("metadata",
                                    {"names": self.names, "pattern": self.pattern}, timeout=30)
        if r.get("missing"):
            raise UnknownStream(f"unknown streams: {', '.join(r['missing'])}")
        new = []
        for d in r["streams"]:
            s = StreamView.from_wire(d)
            if s.name not in self.streams:
                new.append(s)
            self.streams[s.name] = s
            self.by_id[s.id] = s
        if new:
            await self._init_positions(new)

    async def _init_positions(self, streams) -> None:
        saved = await self.committed() if self.group else {}
        latest = []
        for s in streams:
            for i in (range(s.streamlets) if self.only is None else self.only):
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
                r, _ = await self.pool.call(addr, "offsets", {"streamlets": sls}, timeout=30)
                for sid, i, low, pos in r["offsets"]:
                    self.positions[(self.by_id[sid].name, i)] = {"low": low, "groups": dict(pos)}

    def position(self) -> dict:
        """Current positions, JSON-friendly: ``{"stream/streamlet": {"low", "groups"}}``, with
        ``"skip": {group: [pos, records]}`` where the group stopped inside a chunk."""
        out = {}
        for (n, i), p in self.positions.items():
            out[f"{n}/{i}"] = e = {"low": p["low"], "groups": {str(g): v for g, v in p["groups"].items()}}
            skip = {str(g): list(v) for (n2, i2, g), v in self._skips.items() if (n2, i2) == (n, i)}
            if skip:
                e["skip"] = skip
        return out

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
        """Store the current positions as the group's; returns once they are durable."""
        await self._positions().commit(self.group, self.position(),
                                       {n: s.id for n, s in self.streams.items()})

    async def committed(self) -> dict:
        """The group's last committed positions of this consumer's streams (``position``'s shape)."""
        return await self._positions().fetch(self.group, {n: s.id for n, s in self.streams.items()})

    async def poll_chunks(self, timeout: float = 1.0) -> list[Chunk]:
        """Chunks after the current positions, from every broker at once (zero-copy views)."""
        if not self.streams or (self.pattern and time.monotonic() - self._meta_at > 1.0):
            await self._metadata()  # with a pattern: new matching streams join, once a second
        deadline = trio.current_time() + timeout
        while True:
            by_addr: dict[str, list] = {}
            stale = [False]  # some streamlet has no live owner, or a broker refused: ask again
            for (name, i), p in self.positions.items():
                s = self.streams[name]
                addr = s.addrs[i]
                if addr is None:
                    stale[0] = True
                else:
                    by_addr.setdefault(addr, []).append([s.id, i, p["low"], p["groups"]])
            out: list[Chunk] = []
            wait = max(0, int((deadline - trio.current_time()) * 1000))
            async with trio.open_nursery() as n:
                for addr, sls in by_addr.items():
                    n.start_soon(self._pull, addr, sls, wait, out, stale)
            if self._refused is not None:  # auto_offset_reset='none', or an ACL
                err, self._refused = self._refused, None
                raise err
            if stale[0]:
                try:
                    await self._metadata()
                except KeraError:
                    pass
            if out or trio.current_time() >= deadline:
                return out
            if stale[0]:
                await trio.sleep(0.05)

    async def _pull(self, addr: str, sls: list, wait: int, out: list, stale: list) -> None:
        try:
            r, payload = await self.pool.call(addr, "pull", {
                "streamlets": sls, "max_bytes": self.max_bytes,
                "max_wait_ms": min(wait, self.max_wait_ms)}, timeout=wait / 1000 + 30)
        except KeraError as e:
            stale[0] = True
            self.pool.drop(addr)
            if e.code == "unavailable":
                await suspect(self.coordinator, addr)
            return
        if r["errors"]:
            stale[0] = True
            for e in r["errors"]:
                if len(e) > 3 and e[2] == OutOfRange.code:
                    await self._reset(e[0], e[1], e[3])
                elif e[2] == Unauthorized.code:
                    s = self.by_id.get(e[0])
                    self._refused = Unauthorized(f"may not read stream {s.name if s else e[0]}")
        self._absorb(r["entries"], payload, out)

    async def _reset(self, sid: int, i: int, starts: dict) -> None:
        """Our position in a streamlet was freed by retention (``auto_offset_reset``)."""
        s = self.by_id.get(sid)
        if s is None:
            return
        p = self.positions[(s.name, i)]
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

    def _absorb(self, entries, payload, out) -> None:
        at = 0
        for sid, i, gid, _seg, _off, n, nxt in entries:
            s = self.by_id.get(sid)
            if s is None:
                at += n
                continue
            p = self.positions[(s.name, i)]
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

