"""Pulls: durable chunks of many streamlets in one reply, and where a reader starts.

A pull waits (up to ``max_wait_ms``) for data, returns slices of the segments held in
memory and, for segments evicted under the memory budget, chunks read back from a
backup's copy (``tiered``). Only durable data is served, so no lease is needed.
"""

from __future__ import annotations

import trio

from .. import limits
from ..errors import InvalidArgument, KeraError, OutOfRange, Recovering
from ..position import DONE, unpack

MAX_PULL_BYTES = limits.MAX_PULL
MAX_PULL_WAIT = 30.0


class Pulls:
    """``BrokerService``'s consume side (its state: streamlets, durable_event, tiered)."""

    async def rpc_pull(self, meta, payload):
        reqs = meta.get("streamlets")
        if not isinstance(reqs, list):
            raise InvalidArgument("pull needs a list of streamlets")
        max_bytes = meta.get("max_bytes", 1 << 20)
        wait = meta.get("max_wait_ms", 0)
        if not isinstance(max_bytes, int) or not isinstance(wait, (int, float)):
            raise InvalidArgument("max_bytes and max_wait_ms must be numbers")
        max_bytes = max(1, min(max_bytes, MAX_PULL_BYTES))
        self.pulls += 1
        # no lease needed: only durable data is served, a prefix of what any successor holds
        deadline = trio.current_time() + max(0.0, min(wait / 1000, MAX_PULL_WAIT))
        while True:
            event = self.durable_event
            entries, parts, errors, moved = self._collect(reqs, max_bytes)
            if parts or errors or moved or trio.current_time() >= deadline:
                if any(isinstance(p, tuple) for p in parts):
                    parts = await self._read_evicted(parts)
                return {"entries": entries, "errors": errors}, parts
            with trio.move_on_at(deadline):
                await event.wait()

    def _collect(self, reqs, max_bytes):
        entries, parts, errors = [], [], []
        moved = False
        budget = max_bytes
        for r in reqs:
            try:
                stream_id, index, low, positions = r
                if not isinstance(positions, dict) or not isinstance(low, int):
                    raise InvalidArgument("pull entry is [stream_id, streamlet, low, {group: position}]")
                sl = self._streamlet(stream_id, index)
            except KeraError as e:
                errors.append([r[0] if isinstance(r, list) and r else None,
                               r[1] if isinstance(r, list) and len(r) > 1 else None, e.code])
                continue
            except (TypeError, ValueError):
                errors.append([None, None, InvalidArgument.code])
                continue
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
            for gid, si, off, n, nxt in got:
                entries.append([stream_id, index, gid, si, off, n, nxt])
                if n:
                    seg = sl.groups[gid].segments[si]
                    # an evicted segment: read back from a backup before the reply goes
                    part = seg.part(off, n)
                    parts.append(part if part is not None else (seg, gid, off, n))
                    budget -= n
                    self.bytes_out += n
                    self.records_out += seg.records_in(off, off + n) or 0
                else:
                    moved = True
        return entries, parts, errors, moved

    async def _read_evicted(self, parts: list) -> list:
        """The parts of evicted segments, fetched from the backups (segments in parallel)."""
        need = {p[0]: p[1] for p in parts if isinstance(p, tuple)}
        got: dict = {}

        async def one(seg, gid):
            got[seg] = await self.tiered.segment(seg, gid)

        async with trio.open_nursery() as n:
            for seg, gid in need.items():
                n.start_soon(one, seg, gid)
        return [got[p[0]][p[2]:p[2] + p[3]] if isinstance(p, tuple) else p for p in parts]

    def rpc_offsets(self, meta, payload):
        """Latest durable positions of streamlets: where a consumer 'from latest' starts."""
        out, errors = [], []
        for stream_id, index in meta.get("streamlets") or []:
            try:
                low, pos = self._streamlet(stream_id, index).latest()
                out.append([stream_id, index, low, pos])
            except KeraError as e:
                errors.append([stream_id, index, e.code])
        return {"offsets": out, "errors": errors}

    def rpc_seek(self, meta, payload):
        """The first chunk boundary at or after each position, so a reader (Spark's admission
        control) may end a batch at any byte: ``seeks`` [[stream_id, streamlet, group, pos]]."""
        out, errors = [], []
        for stream_id, index, gid, pos in meta.get("seeks") or []:
            try:
                g = self._streamlet(stream_id, index).groups.get(gid)
                out.append([stream_id, index, gid, g.align(pos) if g is not None else pos])
            except KeraError as e:
                errors.append([stream_id, index, e.code])
        return {"positions": out, "errors": errors}

    def rpc_lag(self, meta, payload):
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
                sl = self._streamlet(sid, index)
                out.append([sid, index, *self._behind(sl, int(low),
                                                      {int(g): int(p) for g, p in positions.items()})])
            except KeraError as err:
                errors.append([e[0] if isinstance(e, list) and e else None, err.code])
            except (TypeError, ValueError, AttributeError):
                errors.append([None, InvalidArgument.code])
        return {"lag": out, "errors": errors}

    def _behind(self, sl, low: int, positions: dict) -> tuple[int, int, int]:
        per_byte = self.records_in / self.bytes_in if self.bytes_in else 0.0

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
