"""Pulls: durable chunks of many streamlets in one reply, and where a reader starts.

A pull waits (up to ``max_wait_ms``) for data, returns slices of the segments held in
memory and, for segments evicted under the memory budget, chunks read back from a
backup's copy (``tiered``). Only durable data is served, so no lease is needed.
"""

from __future__ import annotations

import trio

from .. import limits
from ..errors import InvalidArgument, KeraError, OutOfRange, Recovering, Unauthorized

MAX_PULL_BYTES = limits.MAX_PULL
MAX_PULL_WAIT = 30.0


class Pulls:
    """``BrokerService``'s consume side (its state: streamlets, durable_event, tiered)."""

    async def rpc_pull(self, meta, payload, peer):
        reqs = meta["streamlets"]
        max_bytes = meta.get("max_bytes", 1 << 20)
        wait = meta.get("max_wait_ms", 0)
        max_bytes = max(1, min(max_bytes, MAX_PULL_BYTES))
        # no lease needed: only durable data is served, a prefix of what any successor holds
        deadline = trio.current_time() + max(0.0, min(wait / 1000, MAX_PULL_WAIT))
        while True:
            event = self.durable_event
            entries, parts, errors, moved = self._collect(reqs, max_bytes, peer)
            if parts or errors or moved or trio.current_time() >= deadline:
                if any(isinstance(p, tuple) for p in parts):
                    parts = await self._read_evicted(parts)
                return {"entries": entries, "errors": errors}, parts
            with trio.move_on_at(deadline):
                await event.wait()

    def _collect(self, reqs, max_bytes, peer):
        entries, parts, errors = [], [], []
        moved = False
        budget = max_bytes
        for r in reqs:
            try:
                stream_id, index, low, positions = r
                if not isinstance(positions, dict) or not isinstance(low, int):
                    raise InvalidArgument("pull entry is [stream_id, streamlet, low, {group: position}]")
                if not self._may(peer, "read", stream_id):
                    raise Unauthorized()
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

    def rpc_offsets(self, meta, payload, peer):
        """Latest durable positions of streamlets: where a consumer 'from latest' starts."""
        out, errors = [], []
        for stream_id, index in meta.get("streamlets") or []:
            try:
                if not self._may(peer, "describe", stream_id):
                    raise Unauthorized()
                low, pos = self._streamlet(stream_id, index).latest()
                out.append([stream_id, index, low, pos])
            except KeraError as e:
                errors.append([stream_id, index, e.code])
        return {"offsets": out, "errors": errors}

    def rpc_seek(self, meta, payload, peer):
        """The first chunk boundary at or after each position, so a reader (Spark's admission
        control) may end a batch at any byte: ``seeks`` [[stream_id, streamlet, group, pos]]."""
        out, errors = [], []
        for stream_id, index, gid, pos in meta.get("seeks") or []:
            try:
                if not self._may(peer, "describe", stream_id):
                    raise Unauthorized()
                g = self._streamlet(stream_id, index).groups.get(gid)
                out.append([stream_id, index, gid, g.align(pos) if g is not None else pos])
            except KeraError as e:
                errors.append([stream_id, index, e.code])
        return {"positions": out, "errors": errors}
