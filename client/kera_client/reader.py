"""Reading many streams: one pull session per broker covering all its streamlets, chunks out.

A position in a streamlet is ``{"low": g, "groups": {group: pos}}``: groups
below ``low`` are read to their end, a group absent from ``groups`` is read
from its start, and ``pos`` packs (segment << 32 | offset), or -1 once a
closed group was read to its end. Positions are what the broker wrote in the
chunk headers, so they stay valid when a streamlet is recovered elsewhere.

Retention frees old segments: a position before what a broker still holds
is answered ``out_of_range``, and ``auto_offset_reset`` (Kafka's
``auto.offset.reset``) says what then: ``earliest`` (default) moves the
groups concerned to their first retained position (a group freed entirely
is skipped), ``latest`` to the durable end, ``none`` raises ``OutOfRange``.
``resets`` counts how often it happened.

A ``Reader`` may read a million streams. It pulls in one session per broker
(``kera.broker.pull_sessions``, driven by ``sessions``): its streamlets there
are named once, those read from their start as one array, and the broker moves
the positions it answers (acknowledged by the next pull's ``epoch``), so a pull
carries only what the reader moved itself (a rewind, a reset) and the broker
answers from the streamlets that have something new, as one array of entries.
Metadata comes a page at a time, as columns (``metadata``); a consumer opened
on a pattern reads the streams of the first pages while the rest are listed
(``open``); a pattern's new streams are found by asking for those created since
the last look, and only the streams whose owner refused or did not answer are
looked up again. So nothing per poll walks every stream.
``consumer.AsyncConsumer`` adds consumer groups (committed positions) on top.
"""

from __future__ import annotations

import time

import trio

from kera import chunk as chunkfmt
from kera.coordinator.link import CoordinatorLink
from kera.errors import KeraError, Unavailable
from kera.limits import MAX_PULL_STREAMLETS
from kera.position import DONE

from .bulk import bulk, settled
from .metadata import describe, fetch, listed
from .received import Chunk, Record
from .sessions import Sessions
from .stream_view import StreamView

__all__ = ["Chunk", "Reader", "Record"]

def compact(p: dict) -> None:
    """Groups read to their end just above ``low`` fold into it."""
    g = p["groups"]
    while g.get(p["low"]) == DONE:
        del g[p["low"]]
        p["low"] += 1


def copy_position(p):
    return {"low": p["low"], "groups": dict(p["groups"])}


class Reader:
    """``streamlets``: read only these streamlets of each stream (default: all)."""

    def __init__(self, pool, coordinator: str, streams=None, pattern: str | None = None,
                 start="earliest", max_bytes: int = 8 << 20, max_wait_ms: int = 200,
                 auto_offset_reset: str = "earliest", streamlets: list[int] | None = None):
        if not streams and not pattern:
            raise ValueError("give streams or a pattern")
        if auto_offset_reset not in ("earliest", "latest", "none"):
            raise ValueError("auto_offset_reset must be earliest, latest or none")
        self.auto_offset_reset = auto_offset_reset
        self.resets = 0
        self.pool = pool
        self.coordinator = CoordinatorLink(pool, coordinator)
        self.names = list(streams or [])
        self.pattern = pattern
        self.start = start
        self.only = streamlets
        self.max_bytes = max_bytes
        self.max_wait_ms = max_wait_ms
        self.streams: dict[str, StreamView] = {}
        self.by_id: dict[int, StreamView] = {}
        self.positions: dict[tuple, dict] = {}  # (name, streamlet) -> position
        self.records_read = 0
        self._meta_at = 0.0
        self._skips: dict[tuple, tuple[int, int]] = {}   # (name, streamlet, group) -> (pos, records)
        self._top: int | None = None            # the newest stream id a pattern was matched to
        self._listed = True                     # no pattern listing under way (``open``)
        self._list_error: KeraError | None = None   # how the last one failed, for the next poll
        self._dirty: set[tuple] | None = None   # positions moved since the last commit (groups)
        self.sessions = Sessions(self)

    # -- metadata -----------------------------------------------------------------------------
    async def open(self, nursery: trio.Nursery | None = None) -> None:
        """Learn the streams to read. A pattern's listing goes on in ``nursery`` (if given)
        once its first page is learnt, while this reader pulls what it learnt so far: reading
        1,000,000 streams by pattern, the listing alone took half of the time when the reads
        waited for its end."""
        if nursery is None or self.names:
            await self._metadata()
        else:
            await nursery.start(self._listing)

    async def _metadata(self) -> None:
        """Every stream named or matching the pattern, a page at a time: new ones start at
        their starting position, moved ones are read from their new owners."""
        self._meta_at = time.monotonic()
        if self.names:
            tops: list = []
            got = await describe(self.coordinator, self.names, self.pattern, tops=tops)
            await self._learn(got.values())
            self._saw(tops[0])
        else:
            await self._listing()

    async def _listing(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A pattern's streams, each page learnt while the next is listed; ``task_status``
        hears once the first is learnt. Meanwhile polls read what is learnt (the listing is
        not begun again, nor new streams asked for); an error ends the listing and is raised
        by the next poll, whose successor lists again."""
        tops: list = []
        started = False

        async def learn(cols) -> None:
            nonlocal started
            with bulk():
                views = list(cols.views(StreamView))
            settled(len(views))
            await self._learn(views)
            if not started:
                started = True
                task_status.started()

        self._listed = False
        try:
            await listed(self.coordinator, self.pattern, learn, tops=tops)
        except KeraError as e:
            if not started or task_status is trio.TASK_STATUS_IGNORED:
                raise
            self._list_error = e
            return
        finally:
            self._listed = True
        self._meta_at = time.monotonic()
        self._saw(min(tops) if tops else None)
        if not started:
            task_status.started()

    def _saw(self, top: int | None) -> None:
        """Streams up to id ``top`` are known: a pattern's later looks ask for newer ones."""
        self._top = top if self._top is None or top is None else max(self._top, top)

    async def _discover(self) -> None:
        """A pattern's streams created since the last look (not every name again)."""
        self._meta_at = time.monotonic()
        if self._top is None:   # an older coordinator: the whole listing
            await self._metadata()
            return
        got: list[StreamView] = []
        top = await fetch(self.coordinator, (), self.pattern,
                          lambda cols, *_: got.extend(cols.views(StreamView)), since=self._top)
        if top is not None:
            self._top = max(self._top, top)
        await self._learn(got)

    async def _learn(self, views) -> None:
        """Streams as the coordinator describes them now: new ones get positions, and every
        streamlet whose owner changed (or that waits for one) is placed on its owner."""
        new, moved = [], []
        with bulk():
            self._note(views, new, moved)
        if new:
            await self._init_positions(new)
        for v in moved:
            for i in self._mine(v):
                key = (v.name, i)
                if key in self.positions:
                    self.sessions.moved(key, v.addrs[i])

    def _note(self, views, new: list, moved: list) -> None:
        """``views`` into ``streams``: the ``new`` ones, those ``moved`` (owners changed)."""
        streams, by_id = self.streams, self.by_id
        for v in views:
            old = streams.get(v.name)
            if old is not None and old.id != v.id:   # re-created: a new stream under the name
                by_id.pop(old.id, None)
                old = None
            streams[v.name] = by_id[v.id] = v
            if old is None:
                new.append(v)
            elif old.addrs != v.addrs:
                moved.append(v)

    def _mine(self, s: StreamView):
        return range(s.streamlets) if self.only is None else [i for i in self.only if i < s.streamlets]

    def _forget(self, name: str) -> None:
        s = self.streams.pop(name, None)
        if s is None:
            return
        self.by_id.pop(s.id, None)
        for i in range(s.streamlets):
            key = (name, i)
            self.sessions.forget(key)
            self.positions.pop(key, None)

    async def _saved(self, streams) -> dict:
        """The starting positions a consumer group committed for ``streams`` (none here)."""
        return {}

    async def _init_positions(self, streams) -> None:
        saved = await self._saved(streams)
        with bulk():
            latest = self._start_positions(streams, saved)
        if latest:
            await self._latest(latest)
        with bulk():
            place, dirty, positions = self.sessions.place, self._dirty, self.positions
            for s in streams:
                name, addrs = s.name, s.addrs
                for i in self._mine(s):
                    key = (name, i)
                    if key in positions:
                        if dirty is not None and f"{name}/{i}" not in saved:
                            dirty.add(key)   # not the group's yet: the next commit stores it
                        place(key, addrs[i])
        settled(len(streams))

    def _start_positions(self, streams, saved: dict) -> list:
        """Where each new streamlet is read from: the ``start`` given, the group's committed
        position, or its beginning; returns those to read from their end (``latest``)."""
        latest = []
        positions, start = self.positions, self.start
        fixed = start if isinstance(start, dict) else None
        for s in streams:
            name = s.name
            for i in self._mine(s):
                key = (name, i)
                if fixed is not None and key in fixed:
                    positions[key] = copy_position(fixed[key])
                elif saved and f"{name}/{i}" in saved:
                    p = saved[f"{name}/{i}"]
                    positions[key] = {"low": p["low"], "groups": {int(g): v for g, v in p["groups"].items()}}
                    for g, (pos, k) in (p.get("skip") or {}).items():
                        self._skips[(name, i, int(g))] = (pos, k)
                elif start == "latest":
                    latest.append((s, i))
                else:
                    positions[key] = {"low": 0, "groups": {}}
        return latest

    async def _latest(self, latest: list) -> None:
        """Positions at the durable end of these (stream, streamlet)s."""
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

    # -- positions ----------------------------------------------------------------------------
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

    def _moved(self, key: tuple) -> None:
        """``key``'s position changed here: its session hears of it, the next commit too."""
        if self._dirty is not None:
            self._dirty.add(key)
        self.sessions.tell(key)

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

    # -- polling ------------------------------------------------------------------------------
    async def poll_chunks(self, timeout: float = 1.0) -> list[Chunk]:
        """Chunks after the current positions, from every broker at once (zero-copy views)."""
        if self._list_error is not None:
            err, self._list_error = self._list_error, None
            raise err
        if not self._listed:
            pass   # a pattern's listing goes on (``open``): what it learnt is read meanwhile
        elif not self.streams:
            await self._metadata()
        elif self.pattern and time.monotonic() - self._meta_at > 1.0:
            await self._discover()  # with a pattern: new matching streams join, once a second
        return await self.sessions.poll(timeout)

    async def poll(self, timeout: float = 1.0) -> list[Record]:
        out = []
        for c in await self.poll_chunks(timeout):
            out.extend(c.records())
        return out

    async def look_again(self, keys: list) -> None:
        """Streams of streamlets waiting for an owner, looked up again; those deleted
        meanwhile are no longer read."""
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
            if key in self.positions:
                self.sessions.place(key, self.streams[key[0]].addrs[key[1]])
