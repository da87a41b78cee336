"""A reader's pull sessions: which broker reads which streamlet, and the pulls themselves.

One session per broker (``kera.broker.pull_sessions``). A streamlet placed on
its owner is *told* to its session in the next pull: as one row of ``starts``
(an int64 array) when it is read from its start, as an ``add`` entry with its
position otherwise. Each pull names the ``epoch`` of the last answer received,
so the broker moves the positions it answers itself and a lost answer is read
again; a broker that does not (no ``epoch`` in its answer) is told every
position that moved. Answers come as one array of entries (``columns``) over a
payload of back-to-back chunks, checked in one pass (``chunk.scan_headers``);
each chunk is handed out as a ``Chunk`` whose view is made when first used.
Streamlets whose owner refused or did not answer wait (``unplaced``) and are
looked up again, at most every ``LOOK_AGAIN`` seconds.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import trio

from kera import chunk as chunkfmt
from kera.errors import KeraError, OutOfRange, ProtocolError, Unauthorized, UnknownSession
from kera.limits import MAX_PULL_STREAMLETS
from kera.position import DONE

from .admin import suspect
from .bulk import bulk
from .received import Chunk


class Owner(Protocol):
    """What the sessions read and move of the reader that owns them (``reader.Reader``)."""

    pool: object
    coordinator: object
    streams: dict            # name -> StreamView
    by_id: dict              # stream id -> StreamView
    positions: dict          # (name, streamlet) -> {"low", "groups"}
    max_bytes: int
    max_wait_ms: int
    auto_offset_reset: str
    resets: int
    records_read: int
    _skips: dict             # (name, streamlet, group) -> (position, records consumed)
    _dirty: set | None       # positions moved since a consumer group's last commit

    async def look_again(self, keys: list) -> None: ...

LOOK_AGAIN = 0.2   # seconds between lookups of streamlets waiting for an owner
ROW = 7            # an answer's entry: stream id, streamlet, group, segment, offset, length, next


class Link:
    """Our pull session with one broker: its id (0: none yet) and the ``epoch`` of its last
    answer, the streamlets it reads, those to tell it (named first, or moved here since
    the last pull) and those it drops."""

    __slots__ = ("addr", "session", "epoch", "members", "todo", "drops")

    def __init__(self, addr: str):
        self.addr = addr
        self.session = 0
        self.epoch = 0
        self.members: set[tuple] = set()
        self.todo: dict[tuple, None] = {}
        self.drops: list = []


class Sessions:
    """The reader's sessions: ``links`` (address -> ``Link``), ``where`` (streamlet -> its
    link) and ``unplaced`` (no live owner known, or it refused)."""

    def __init__(self, reader: Owner):
        self.reader = reader
        self.links: dict[str, Link] = {}
        self.where: dict[tuple, Link] = {}
        self.unplaced: dict[tuple, None] = {}
        self.looked_at = 0.0
        self.refused: KeraError | None = None   # raised by the next poll

    # -- placement ----------------------------------------------------------------------------
    def place(self, key: tuple, addr: str | None) -> None:
        """Read ``key`` from ``addr`` (its owner): its position goes in the next pull there."""
        old = self.where.get(key)
        if old is not None and old.addr != addr:
            self.forget(key)
            old = None
        if addr is None:
            self.unplaced[key] = None
            return
        if self.unplaced:
            self.unplaced.pop(key, None)
        link = self.links.get(addr)
        if link is None:
            link = self.links[addr] = Link(addr)
        self.where[key] = link
        link.members.add(key)
        link.todo[key] = None

    def moved(self, key: tuple, addr: str | None) -> None:
        """``key``'s owner may have changed: placed again if it did (or waits for one)."""
        link = self.where.get(key)
        if link is None or link.addr != addr:
            self.place(key, addr)

    def forget(self, key: tuple) -> None:
        """``key`` is no longer read where it was (its session drops it)."""
        link = self.where.pop(key, None)
        if link is not None:
            link.members.discard(key)
            link.todo.pop(key, None)
            s = self.reader.streams.get(key[0])
            if s is not None and link.session:
                link.drops.append([s.id, key[1]])
        self.unplaced.pop(key, None)

    def tell(self, key: tuple) -> None:
        """The reader moved ``key``'s position itself: its session hears of it."""
        link = self.where.get(key)
        if link is not None:
            link.todo[key] = None

    def _wait_owner(self, key: tuple) -> None:
        link = self.where.pop(key, None)
        if link is not None:
            link.members.discard(key)
            link.todo.pop(key, None)
        self.unplaced[key] = None

    # -- polling ------------------------------------------------------------------------------
    async def poll(self, timeout: float) -> list:
        deadline = trio.current_time() + timeout
        while True:
            if self.unplaced and time.monotonic() - self.looked_at >= LOOK_AGAIN:
                self.looked_at = time.monotonic()
                await self.reader.look_again(list(self.unplaced))
            out: list = []
            wait = max(0, int((deadline - trio.current_time()) * 1000))
            links = [link for link in self.links.values() if link.members or link.drops]
            async with trio.open_nursery() as n:
                for link in links:
                    n.start_soon(self._pull, link, wait, out)
            if self.refused is not None:  # auto_offset_reset='none', or an ACL
                err, self.refused = self.refused, None
                raise err
            if out or trio.current_time() >= deadline:
                return out
            if self.unplaced or not links:
                await trio.sleep(min(0.05, max(0.0, deadline - trio.current_time())))

    def _request(self, link: Link, wait: int) -> tuple[dict, list]:
        """The next pull's fields in ``link``'s session, and the streamlets it adds."""
        r = self.reader
        positions, streams = r.positions, r.streams
        add, starts, told, units = [], [], [], 0
        todo = link.todo
        while todo and units < MAX_PULL_STREAMLETS - 64:
            key, _ = todo.popitem()
            p = positions[key]
            sid = streams[key[0]].id
            told.append(key)
            if p["low"] == 0 and not p["groups"]:
                starts += (sid, key[1])
                units += 1
            else:
                add.append([sid, key[1], p["low"], p["groups"]])
                units += 1 + len(p["groups"]) // 8
        drops, link.drops = link.drops[:MAX_PULL_STREAMLETS], link.drops[MAX_PULL_STREAMLETS:]
        meta = {"session": link.session, "epoch": link.epoch, "add": add, "drop": drops,
                "columns": True, "max_bytes": r.max_bytes,
                "max_wait_ms": 0 if todo else min(wait, r.max_wait_ms)}
        if starts:
            meta["starts"] = np.array(starts, "<i8").tobytes()
        return meta, told

    async def _pull(self, link: Link, wait: int, out: list) -> None:
        """One pull in ``link``'s session: what the reader told it (and the streamlets left),
        then what the broker has that is new."""
        meta, told = self._request(link, wait)
        try:
            r, payload = await self.reader.pool.call(link.addr, "pull", meta, timeout=wait / 1000 + 30)
        except KeraError as e:
            await self._failed(link, told, e)
            return
        link.session = r["session"]
        tracked = "epoch" in r   # the broker moves the positions it answers
        link.epoch = r.get("epoch", 0)
        for e in r["errors"]:
            await self._refusal(link, e)
        entries = r["entries"]
        if type(entries) is bytes and len(entries) % (8 * ROW):
            raise ProtocolError("pull answer: entries are not whole rows")
        with bulk():
            if type(entries) is bytes:
                entries = np.frombuffer(entries, "<i8").reshape(-1, ROW).tolist()
            self._absorb(entries, payload, out, None if tracked else link)

    async def _failed(self, link: Link, told: list, e: KeraError) -> None:
        for key in told:   # told again in the next pull (if still read there)
            if self.where.get(key) is link:
                link.todo[key] = None
        if e.code == UnknownSession.code:   # it restarted, or forgot us: name them all again
            link.session, link.epoch = 0, 0
            link.drops = []
            for key in link.members:
                link.todo[key] = None
            return
        self.reader.pool.drop(link.addr)
        if e.code == "unavailable":
            await suspect(self.reader.coordinator, link.addr)
        for key in list(link.members):   # who owns them now? (once per failure, not per poll)
            self._wait_owner(key)
        self.links.pop(link.addr, None)

    async def _refusal(self, link: Link, e: list) -> None:
        """A streamlet the broker refused (it left the session)."""
        r = self.reader
        s = r.by_id.get(e[0])
        key = (s.name, e[1]) if s is not None else None
        if key is None or key not in r.positions:
            return
        if len(e) > 3 and e[2] == OutOfRange.code:
            await self._reset(e[0], e[1], e[3])
            link.todo[key] = None   # named again, from where it goes on
        elif e[2] == Unauthorized.code:   # the next poll raises
            self.refused = Unauthorized(f"may not read stream {s.name}")
        elif self.where.get(key) is link:   # not owned there, recovering: who owns it now?
            self._wait_owner(key)

    async def _reset(self, sid: int, i: int, starts: dict) -> None:
        """Our position in a streamlet was freed by retention (``auto_offset_reset``)."""
        r = self.reader
        s = r.by_id.get(sid)
        if s is None:
            return
        p = r.positions[(s.name, i)]
        if r._dirty is not None:
            r._dirty.add((s.name, i))
        if r.auto_offset_reset == "none":
            self.refused = OutOfRange(f"stream {s.name} streamlet {i}: position {p} is "
                                      f"before the retained data")
            return
        r.resets += 1
        if r.auto_offset_reset == "latest":
            a, _ = await r.pool.call(s.addrs[i], "offsets", {"streamlets": [[sid, i]]}, timeout=30)
            for _, _, low, pos in a["offsets"]:
                r.positions[(s.name, i)] = {"low": low, "groups": dict(pos)}
            return
        held = {int(g): v for g, v in starts["groups"].items()}
        for g, v in list(p["groups"].items()):
            if v == DONE:
                continue
            if g not in held:
                p["groups"][g] = DONE  # freed entirely
            elif v < held[g]:
                p["groups"][g] = held[g]
        while p["groups"].get(p["low"]) == DONE:
            del p["groups"][p["low"]]
            p["low"] += 1

    def _absorb(self, entries, payload, out: list, link: Link | None) -> None:
        """An answer's entries into positions and chunks (``link``: told every position that
        moved, for a broker that does not move them itself)."""
        r = self.reader
        heads, offs = chunkfmt.scan_headers(payload) if len(payload) else (None, [])
        if offs:
            placed = ((heads["segment"].astype(np.int64) << 32) | heads["offset"]).tolist()
            counts = heads["record_count"].tolist()
        by_id, positions, skips = r.by_id, r.positions, r._skips
        dirty = r._dirty
        at = j = 0
        nchunks, size = len(offs), len(payload)
        read = 0
        for sid, i, gid, _seg, _off, n, nxt in entries:
            s = by_id.get(sid)
            name = s.name if s is not None else None
            key = (name, i)
            p = positions.get(key)
            if n:
                end = at + n
                if end > size or (offs[j] if j < nchunks else size) != at:
                    raise ProtocolError("pull answer: an entry is not whole chunks of the payload")
                while j < nchunks and offs[j] < end:
                    if p is not None:
                        pos, k = placed[j], counts[j]
                        skip = 0
                        if skips:
                            sk = skips.get((name, i, gid))
                            if sk is not None and sk[0] == pos:
                                skip = chunkfmt.skip_in(chunkfmt.ChunkView(payload, offs[j]), sk[1])
                                del skips[(name, i, gid)]
                        if skip < k:
                            out.append(Chunk(name, i, gid, pos, payload, offs[j], k, skip))
                        read += k - skip
                    j += 1
                if (offs[j] if j < nchunks else size) != end:
                    raise ProtocolError("pull answer: an entry is not whole chunks of the payload")
                at = end
            if p is None:
                continue
            if dirty is not None:
                dirty.add(key)
            if link is not None:
                link.todo[key] = None
            p["groups"][gid] = nxt
            while p["groups"].get(p["low"]) == DONE:
                del p["groups"][p["low"]]
                p["low"] += 1
        r.records_read += read
