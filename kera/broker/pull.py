"""Pulls: durable chunks of many streamlets in one reply, and where a reader starts.

A pull waits (up to ``max_wait_ms``) for data, returns slices of the segments held in
memory and, for segments evicted under the memory budget, chunks read back from a
backup's copy (``tiered``). Only durable data is served, so no lease is needed.

A plain pull names its streamlets and positions (at most ``MAX_PULL_STREAMLETS``);
a pull in a session (``pull_sessions``) names only what changed since the last one
(streamlets read from their start may come as one array, ``starts``). Either
answers at most ``MAX_PULL_STREAMLETS`` entries, as lists or, asked ``columns``,
as one int64 array of rows (``ENTRY``: what a reader of 100,000 streamlets decodes
in one call instead of 100,000 lists).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import trio

from .. import limits
from ..errors import InvalidArgument, KeraError, OutOfRange, Recovering, Unauthorized
from ..position import DONE, unpack
from ..security.mechanisms import CLIENT
from .pull_sessions import PullSession, PullSessions
from .streamlet import Streamlet
from .tiered import TieredReader

# an entry of an answer: the streamlet, a group read, where its bytes start, their length and
# the position after them (DONE: the group was read to its end)
ENTRY = ("stream_id", "streamlet", "group", "segment", "offset", "length", "next")

MAX_PULL_WAIT = 30.0


class Served(Protocol):
    """What the consume side reads of the broker: its streamlets, the readers' pull sessions,
    the reader of evicted segments, the event set whenever more is durable, the counters
    a pull adds to (and the produce side's, which price a lag in records), and the checks
    of a reader's rights and of a streamlet served here."""

    streamlets: dict
    sessions: PullSessions
    tiered: TieredReader | None
    durable_event: trio.Event
    pulls: int
    records_out: int
    bytes_out: int
    records_in: int
    bytes_in: int

    def _may(self, peer, op: str, stream_id) -> bool: ...
    def _streamlet(self, stream_id, index) -> Streamlet: ...


class Pulls:
    """The broker's consume side: pulls, offsets, seeks and lag, served from what the broker
    holds (``Served``); it keeps no state of its own."""

    def __init__(self, broker: Served):
        self.broker = broker

    async def pull(self, meta, payload, peer):
        max_bytes = meta.get("max_bytes", limits.DEFAULT_PULL)
        wait = meta.get("max_wait_ms", 0)
        max_bytes = max(1, min(max_bytes, limits.MAX_PULL))
        self.broker.pulls += 1
        # no lease needed: only durable data is served, a prefix of what any successor holds
        deadline = trio.current_time() + max(0.0, min(wait / 1000, MAX_PULL_WAIT))
        if meta.get("session") is not None:
            return await self._pull_session(meta, max_bytes, deadline, peer)
        reqs = meta.get("streamlets")
        if reqs is None:
            raise InvalidArgument("pull needs streamlets, or a session")
        while True:
            event = self.broker.durable_event
            entries, parts, errors, moved = self._collect(reqs, max_bytes, peer)
            if parts or errors or moved or trio.current_time() >= deadline:
                if any(isinstance(p, tuple) for p in parts):
                    entries, parts = await self._read_evicted(entries, parts, errors)
                return {"entries": _shaped(entries, meta.get("columns")), "errors": errors}, parts
            with trio.move_on_at(deadline):
                await event.wait()

    async def _pull_session(self, meta, max_bytes: int, deadline: float, peer):
        """A pull in a session (``pull_sessions``): ``session`` 0 opens one; ``epoch`` (the last
        answer the reader got) lets the broker move the positions it answers; ``add`` sets
        positions ([stream id, streamlet, low, {group: position}], as a plain pull's
        entries), ``starts`` (int64 pairs of stream id and streamlet) names streamlets read
        from their start, ``drop`` ([stream id, streamlet]) leaves streamlets; the answer
        names the session (and its ``epoch``) and reads its ready streamlets."""
        sid = meta["session"]
        # a session is its opener's: another principal naming it is told it does not exist
        s = self.broker.sessions.open(peer.principal) if sid == 0 else self.broker.sessions.get(sid, peer.principal)
        epoch = meta.get("epoch")
        s.acknowledged(epoch)
        errors = []
        judge = self._judge(peer)
        for r in meta.get("drop") or []:
            s.drop((r[0], r[1]))
        for r in meta.get("add") or []:
            e = self._entry(r, errors, peer)
            if e is not None:
                s.set((e[0], e[1]), e[2], e[3])
        if meta.get("starts"):
            self._starts(s, meta["starts"], errors, judge)
        while True:
            s.event = trio.Event()
            entries, parts, more = self._collect_ready(s, max_bytes, errors, judge, epoch is not None)
            if parts or errors or more or trio.current_time() >= deadline:
                s.epoch += 1   # before any wait: an answer that never goes out is read again
                if any(isinstance(p, tuple) for p in parts):
                    entries, parts = await self._read_evicted(entries, parts, errors, s)
                return {"session": s.id, "epoch": s.epoch, "errors": errors,
                        "entries": _shaped(entries, meta.get("columns"))}, parts
            with trio.move_on_at(deadline):
                await s.event.wait()

    def _judge(self, peer):
        """Whether ``peer`` may read a stream, by id; None when it may read every stream (a
        member, or user authentication off): nothing to ask per streamlet."""
        if peer.role is not None and (peer.role != CLIENT or not peer.gate.auth):
            return None
        return lambda stream_id: self.broker._may(peer, "read", stream_id)

    def _starts(self, s: PullSession, starts: bytes, errors: list, judge) -> None:
        """Streamlets the reader reads from their start (``starts``: int64 pairs)."""
        if len(starts) % 16:
            raise InvalidArgument("pull: starts must be int64 pairs of stream id and streamlet")
        streamlets = self.broker.streamlets
        for sid, index in np.frombuffer(starts, "<i8").reshape(-1, 2).tolist():
            key = (sid, index)
            sl = streamlets.get(key)
            try:
                if judge is not None and not judge(sid):
                    raise Unauthorized()
                if sl is None or sl.recovering:
                    self.broker._streamlet(sid, index)   # raises the right error
            except KeraError as e:
                errors.append([sid, index, e.code])
                continue
            s.set(key, 0, {})

    def _collect_ready(self, s: PullSession, max_bytes: int, errors: list, judge, moves: bool):
        """Read the session's ready streamlets (each once) while the budget lasts; those that
        failed leave the session with their error. With ``moves`` the positions after each
        read are the session's tentatively (``PullSession.moved``) and a streamlet read to
        its end is not ready again until touched; otherwise each that gave data stays ready."""
        entries, parts = [], []
        moved = False
        budget = max_bytes
        streamlets = self.broker.streamlets
        for _ in range(len(s.queued)):
            if budget <= 0 or len(entries) + len(errors) >= limits.MAX_PULL_STREAMLETS - 64:
                break
            key = s.take()
            if key is None:
                break
            low, positions = s.position(key)
            sl = streamlets.get(key)
            try:
                if judge is not None and not judge(key[0]):   # the ACLs may have changed since
                    raise Unauthorized()
                if sl is None or sl.recovering:
                    sl = self.broker._streamlet(*key)   # raises the right error
                got = sl.read(low, positions, budget)
            except OutOfRange:
                errors.append([key[0], key[1], OutOfRange.code, sl.starts()])
                s.drop(key)
                continue
            except KeraError as e:
                errors.append([key[0], key[1], e.code])
                s.drop(key)
                continue
            except (TypeError, ValueError):
                errors.append([key[0], key[1], InvalidArgument.code])
                s.drop(key)
                continue
            moved = self._entries(key[0], key[1], got, entries, parts, sl) or moved
            budget -= sum(e[3] for e in got)
            if got:
                if not moves or budget <= 0:
                    s.mark(key)   # there may be more
                if moves:
                    s.moved[key] = _after(low, positions, got)
        return entries, parts, moved

    def _entries(self, stream_id: int, index: int, got: list, entries: list, parts: list,
                 sl=None) -> bool:
        """A streamlet's read into a pull's entries and parts; True if it moved with no data."""
        moved = False
        if sl is None:
            sl = self.broker.streamlets[(stream_id, index)]
        for gid, si, off, n, nxt in got:
            entries.append((stream_id, index, gid, si, off, n, nxt))
            if n:
                seg = sl.groups[gid].segments[si]
                # an evicted segment: read back from a backup before the reply goes
                part = seg.part(off, n)
                parts.append(part if part is not None else (seg, gid, off, n))
                self.broker.bytes_out += n
                self.broker.records_out += seg.records_in(off, off + n) or 0
            else:
                moved = True
        return moved

    def _entry(self, r, errors: list, peer) -> tuple | None:
        """A pull entry [stream id, streamlet, low, {group: position}] of a streamlet held
        here, with the streamlet; None (the error noted in ``errors``) otherwise."""
        try:
            stream_id, index, low, positions = r
            if not isinstance(positions, dict) or not isinstance(low, int):
                raise InvalidArgument("pull entry is [stream_id, streamlet, low, {group: position}]")
            if not self.broker._may(peer, "read", stream_id):
                raise Unauthorized()
            return stream_id, index, low, positions, self.broker._streamlet(stream_id, index)
        except KeraError as e:
            errors.append([r[0] if isinstance(r, list) and r else None,
                           r[1] if isinstance(r, list) and len(r) > 1 else None, e.code])
        except (TypeError, ValueError):
            errors.append([None, None, InvalidArgument.code])
        return None

    def _collect(self, reqs, max_bytes, peer):
        entries, parts, errors = [], [], []
        moved = False
        budget = max_bytes
        for r in reqs:
            if len(entries) + len(errors) >= limits.MAX_PULL_STREAMLETS - 64:
                break
            e = self._entry(r, errors, peer)
            if e is None:
                continue
            stream_id, index, low, positions, sl = e
            if budget <= 0:
                continue
            try:
                got = sl.read(low, positions, budget)
            except OutOfRange:
                errors.append([stream_id, index, OutOfRange.code, sl.starts()])
                continue
            except Recovering:   # older groups still being adopted: this streamlet waits, not others
                errors.append([stream_id, index, Recovering.code])
                continue
            except (TypeError, ValueError):
                errors.append([stream_id, index, InvalidArgument.code])
                continue
            moved = self._entries(stream_id, index, got, entries, parts) or moved
            budget -= sum(e[3] for e in got)
        return entries, parts, errors, moved

    async def _read_evicted(self, entries: list, parts: list, errors: list,
                            s: PullSession | None = None) -> tuple[list, list]:
        """The entries and parts of a pull with its evicted segments' parts fetched from the
        backups (segments in parallel). A streamlet one of whose segments no copy can be
        read leaves the answer (and the session) with its error, ``BackupError``: its reader
        asks again; the other streamlets are served."""
        need = {p[0]: p[1] for p in parts if isinstance(p, tuple)}
        got: dict = {}
        failed: dict = {}

        async def one(seg, gid):
            try:
                got[seg] = await self.broker.tiered.segment(seg, gid)
            except KeraError as e:
                failed[seg] = e

        async with trio.open_nursery() as n:
            for seg, gid in need.items():
                n.start_soon(one, seg, gid)
        if failed:
            entries, parts = _without(entries, parts, failed, errors, s)
        return entries, [got[p[0]][p[2]:p[2] + p[3]] if isinstance(p, tuple) else p for p in parts]

    def offsets(self, meta, payload, peer):
        """Latest durable positions of streamlets (at most ``MAX_PULL_STREAMLETS``): where a
        consumer 'from latest' starts."""
        out, errors = [], []
        for stream_id, index in meta.get("streamlets") or []:
            try:
                if not self.broker._may(peer, "describe", stream_id):
                    raise Unauthorized()
                low, pos = self.broker._streamlet(stream_id, index).latest()
                out.append([stream_id, index, low, pos])
            except KeraError as e:
                errors.append([stream_id, index, e.code])
        return {"offsets": out, "errors": errors}

    def seek(self, meta, payload, peer):
        """The first chunk boundary at or after each position, so a reader (Spark's admission
        control) may end a batch at any byte: ``seeks`` [[stream_id, streamlet, group, pos]]."""
        out, errors = [], []
        for stream_id, index, gid, pos in meta.get("seeks") or []:
            try:
                if not self.broker._may(peer, "describe", stream_id):
                    raise Unauthorized()
                g = self.broker._streamlet(stream_id, index).groups.get(gid)
                out.append([stream_id, index, gid, g.align(pos) if g is not None else pos])
            except KeraError as e:
                errors.append([stream_id, index, e.code])
        return {"positions": out, "errors": errors}

    def lag(self, meta, payload):
        """How far committed positions are behind the durable end of their streamlets:
        ``positions`` [[stream_id, streamlet, low, {group: position}]] answered as ``lag``
        [[stream_id, streamlet, records behind, bytes behind, records held]] (a consumer
        group's lag, measured where the data is: ``kera.metrics.lag``). Costs a bisection per
        segment held, nothing per record."""
        out, errors = [], []
        entries = meta.get("positions")
        if not isinstance(entries, list):
            raise InvalidArgument("lag needs positions [[stream_id, streamlet, low, {group: position}]]")
        for e in entries:
            try:
                sid, index, low, positions = e
                sl = self.broker._streamlet(sid, index)
                out.append([sid, index, *self._behind(sl, int(low),
                                                      {int(g): int(p) for g, p in positions.items()})])
            except KeraError as err:
                errors.append([e[0] if isinstance(e, list) and e else None, err.code])
            except (TypeError, ValueError, AttributeError):
                errors.append([None, InvalidArgument.code])
        return {"lag": out, "errors": errors}

    def _behind(self, sl, low: int, positions: dict) -> tuple[int, int, int]:
        per_byte = self.broker.records_in / self.broker.bytes_in if self.broker.bytes_in else 0.0

        def records(seg, start, end):
            n = seg.records_in(start, end)
            return round((end - start) * per_byte) if n is None else n

        behind = nbytes = held = 0
        for gid, g in sl.groups.items():
            segs = g.segments[g.start:]
            held += sum(records(seg, 0, seg.durable) for seg in segs)
            pos = positions.get(gid)
            if gid < low or pos == DONE:
                continue
            si, off = unpack(pos) if pos is not None else (g.start, 0)
            if si < g.start:
                si, off = g.start, 0
            for seg in g.segments[si:]:
                start = off if seg.id == si else 0
                if seg.durable > start:
                    behind += records(seg, start, seg.durable)
                    nbytes += seg.durable - start
        return behind, nbytes, held


def _shaped(entries: list, columns) -> list | bytes:
    """An answer's entries: a list per entry, or (``columns``) one int64 array of ``ENTRY`` rows."""
    if columns:
        return np.array(entries, "<i8").reshape(-1, len(ENTRY)).tobytes()
    return [list(e) for e in entries]


def _after(low: int, positions: dict, got: list) -> tuple[int, dict]:
    """A reader's position in a streamlet after the entries ``got`` of a read from it (groups
    read to their end below ``low`` fold into it, as the reader's own position does)."""
    groups = dict(positions)
    for gid, _si, _off, _n, nxt in got:
        groups[gid] = nxt
    while groups.get(low) == DONE:
        del groups[low]
        low += 1
    return low, groups


def _without(entries: list, parts: list, failed: dict, errors: list, s: PullSession | None) -> tuple[list, list]:
    """``entries`` and ``parts`` (one per entry carrying bytes) without the streamlets one of
    whose parts lies in a segment of ``failed`` (segment -> its error), each of those noted
    in ``errors`` and dropped from the session ``s``, as any streamlet that fails."""
    bad: dict = {}
    it = iter(parts)
    shares = [next(it) if e[5] else None for e in entries]
    for e, p in zip(entries, shares, strict=True):
        if type(p) is tuple and p[0] in failed:
            bad.setdefault((e[0], e[1]), failed[p[0]])
    kept = [(e, p) for e, p in zip(entries, shares, strict=True) if (e[0], e[1]) not in bad]
    for (sid, index), err in bad.items():
        errors.append([sid, index, err.code])
        if s is not None:
            s.drop((sid, index))
    return [e for e, _ in kept], [p for _, p in kept if p is not None]
