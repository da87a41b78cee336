"""BrokerService: the broker process.

Producer requests carry chunks for many streamlets; each chunk is verified,
appended with one copy into its streamlet's active group, stamped with its
placement, and referenced in its virtual log. The request then waits (for
``acks=all``) until every vlog it touched is durable past its chunks. Pulls
return durable chunks of many streamlets as slices of the segments, or, for
segments evicted from memory, as chunks read back from a backup's copy.

A background pass (``_reclaim``) applies retention (whole segments freed),
releases the vsegs nothing live references (their backups delete the files)
and evicts replicated segments down to the memory budget's low-water mark.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np
import trio

from .. import chunk, index_chunk, limits, metafile
from ..coordinator_link import CoordinatorLink
from ..errors import (
    Conflict,
    Fenced,
    InvalidArgument,
    KeraError,
    NotOwner,
    OutOfRange,
    ProtocolError,
    Recovering,
    Unavailable,
    UnknownMember,
)
from ..rpc import Pool, Service
from ..vlog import BackupSet, VirtualLog, VlogMapping
from .adopted import AdoptedSegment, Claims, IndexHolder, adopted_segment
from .compactor import Compactor
from .group_close import close_chunk, mark
from .memory import MemoryBudget, default_budget
from .replicator import Replicator
from .segment import VlogChunk, close_waiting
from .streamlet import Streamlet
from .tiered import TieredReader

log = logging.getLogger("kera.broker")

MAX_PULL_BYTES = limits.MAX_PULL
# flags only brokers set (index, close and compacted chunks): refused in a client's chunk
BROKER_FLAGS = chunk.INDEX | chunk.CLOSE | chunk.COMPACTED
MAX_PULL_WAIT = 30.0
HEARTBEAT = 0.5
RECLAIM_INTERVAL = 0.25
TIERED_CACHE = 32 << 20   # bytes of evicted segments read back, kept for the next pulls


class BrokerService(Service):
    def __init__(self, coordinator: str, data_dir: str, node: str, mapping: VlogMapping,
                 vseg_size: int = limits.DEFAULT_VSEG_SIZE, replicate_timeout: float = 5.0,
                 memory: int = 0):
        self.coordinator = coordinator
        self.data_dir = data_dir
        self.node = node
        self.mapping = mapping
        self.vseg_size = vseg_size
        self.replicate_timeout = replicate_timeout
        self.memory = MemoryBudget(memory)
        os.makedirs(data_dir, exist_ok=True)
        self.id_path = os.path.join(data_dir, "broker.id")
        ident = metafile.load(self.id_path) or {}
        self.broker_id: int | None = ident.get("id")
        self.epoch = 0
        self.addr = ""
        self.streams: dict[int, dict] = {}
        self.streamlets: dict[tuple[int, int], Streamlet] = {}
        self.compactor = Compactor(self.streamlets, self.memory, self._free)  # key compaction
        self.vlogs: dict[tuple, Replicator] = {}
        self.backups: dict[int, dict] = {}
        self.backup_set = BackupSet(node)
        self.durable_event = trio.Event()
        self.pool: Pool | None = None
        self.nursery: trio.Nursery | None = None
        self.requests = 0
        self.fenced = False
        self.heartbeat = HEARTBEAT
        self.lease = 0.0           # seconds a heartbeat answer lets us serve
        self.lease_until = 0.0     # monotonic time our lease ends
        self.tiered: TieredReader | None = None
        self.claims: Claims | None = None   # foreign vsegs of adopted segments (kera.broker.adopted)
        self.freed_segments = 0    # by retention or deletion
        self.freed_bytes = 0

    # -- virtual logs ----------------------------------------------------------------
    def notify_durable(self) -> None:
        self.durable_event.set()
        self.durable_event = trio.Event()

    def backup_addr(self, backup_id: int) -> str:
        b = self.backups.get(backup_id)
        if b is None:
            raise Unavailable(f"backup {backup_id} is not alive")
        return b["addr"]

    def vlog_for(self, stream: dict, streamlet: int, g) -> Replicator:
        """The group's virtual log (chosen on its first chunk, then cached on it)."""
        if g.vlog is not None:
            return g.vlog
        key = self.mapping.key(stream, streamlet, g.id)
        v = self.vlogs.get(key)
        if v is None:
            # ids unique across incarnations: a restarted broker never mixes with its old replicas
            vid = (self.epoch << 32) | len(self.vlogs)
            vlog = VirtualLog(vid, stream["replication"], self.vseg_size, self.backup_set,
                              self.replicate_timeout)
            v = self.vlogs[key] = Replicator(vlog, self.pool, lambda: (self.broker_id, self.epoch),
                                             self.backup_addr, self.notify_durable,
                                             lambda: [(b, m["addr"]) for b, m in self.backups.items()])
            self.nursery.start_soon(v.run)
        g.vlog = v
        return v

    # -- control -----------------------------------------------------------------
    def _check_epoch(self, meta) -> None:
        if self.fenced or meta.get("epoch") != self.epoch:
            raise Fenced(f"broker {self.broker_id} is at epoch {self.epoch}, request for {meta.get('epoch')}")

    def rpc_assign(self, meta, payload):
        """Streamlets to own; ``recovering`` ones are rebuilt by backups before they serve.

        One stream (``stream``, ``streamlets``) or many (``streams``: [[stream, streamlets],
        ...]): a batch of new streams costs one request per broker.
        """
        self._check_epoch(meta)
        entries = meta.get("streams")
        if entries is None:
            entries = [[meta.get("stream"), meta.get("streamlets")]]
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], dict) and isinstance(e[1], list)
                for e in entries):
            raise InvalidArgument("assign needs a stream and streamlets")
        recovering = meta.get("recovering") is True
        seal = meta.get("seal") is True
        backups = meta.get("backups")
        if backups is not None and not (isinstance(backups, list) and all(
                isinstance(b, dict) and {"id", "addr", "node", "epoch"} <= b.keys() for b in backups)):
            raise InvalidArgument("assign: backups must be [{id, addr, node, epoch}, ...]")
        if backups is not None:
            # the coordinator's view as of this stream: its first vsegs get copies on every
            # node, not only on the backups our last heartbeat answer knew of
            self._set_backups(backups)
        for s, streamlets in entries:
            self._assign(s, streamlets, recovering, seal)
        self.notify_durable()  # pulls waiting on these streamlets look again
        return {}

    def _assign(self, s: dict, streamlets: list, recovering: bool, seal: bool) -> None:
        self.streams[s["id"]] = s
        for i in streamlets:
            sl = self.streamlets.get((s["id"], i))
            if sl is not None:
                sl.configure(s)
            if sl is None:
                sl = self.streamlets[(s["id"], i)] = Streamlet(s, i, self.memory)
                sl.on_close = self._close_group
                sl.recovering = recovering
            elif sl.recovering and not recovering:
                sl.finish_recovery()
                self._free(sl.expired(time.time(), settled_only=False))
                if seal:
                    log.error("stream %s streamlet %d: recovered with data lost; its groups are sealed",
                              s.get("name"), i)
                    sl.seal()

    def rpc_configure(self, meta, payload):
        """A stream's changed configuration (retention): applied by the next reclaim pass."""
        self._check_epoch(meta)
        s = meta.get("stream")
        if not isinstance(s, dict) or not isinstance(s.get("id"), int):
            raise InvalidArgument("configure needs a stream")
        if s["id"] in self.streams:
            self.streams[s["id"]] = s
            for (sid, _), sl in self.streamlets.items():
                if sid == s["id"]:
                    sl.configure(s)
        return {}

    def _free(self, segments) -> None:
        """Segments gone for good: their memory, their share of their vsegs' lives."""
        for seg in segments:
            if seg.freed and seg.buf is None and seg.capacity == 0:
                continue  # a placeholder (recovery) never held anything
            settled = seg.replicated()
            self.memory.free(seg)
            if self.tiered is not None:
                self.tiered.forget(seg)
            if isinstance(seg, AdoptedSegment):
                self.claims.free(seg)
            for vs in seg.vsegs:
                vs.live -= 1
                if settled:
                    vs.frozen = True
            self.freed_segments += 1
            self.freed_bytes += seg.head
            seg.freed = True
            if settled:  # else its vsegs still send from it; they drop it when released
                seg.drop_buffer()
            seg.vsegs, seg.ends = [], []

    def _close_group(self, sl: Streamlet, g, producer: int) -> None:
        """``g`` is full and closed: its close chunk goes to its vlog, after all its chunks."""
        c = close_chunk(sl.stream_id, sl.index, g, producer)
        self._append_close(sl, g, c, chunk.parse_header(c.view).body_checksum)

    def _append_close(self, sl: Streamlet, g, c: VlogChunk, body_checksum: int) -> tuple:
        vlog = self.vlog_for(self.streams[sl.stream_id], sl.index, g)
        return vlog, vlog.append(c, 0, c.head, body_checksum)

    def rpc_unassign(self, meta, payload):
        """Streamlets to drop: of one stream (``stream_id``, ``streamlets``, all if None) or of
        many (``streams``: [[stream id, streamlets or None], ...]). Costs what is dropped,
        not what this broker holds."""
        entries = meta.get("streams")
        if entries is None:
            entries = [[meta.get("stream_id"), meta.get("streamlets")]]
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 2 and (e[1] is None or isinstance(e[1], list))
                for e in entries):
            raise InvalidArgument("unassign needs [[stream id, streamlets or None], ...]")
        for sid, only in entries:
            s = self.streams.get(sid)
            if s is None:
                continue
            every = range(s.get("streamlets", 0))
            for i in every if only is None else only:
                sl = self.streamlets.pop((sid, i), None)
                if sl is not None:
                    self._free(sl.everything())
                    sl.groups.clear()
                    sl.producers.clear()
            if not any((sid, i) in self.streamlets for i in every):
                self.streams.pop(sid, None)
        self._reclaim_once()
        return {}

    def rpc_ping(self, meta, payload):
        return {"broker": self.broker_id, "epoch": self.epoch}

    async def rpc_recover(self, meta, payload):
        """Chunks replayed by a backup: placed where their headers say, then replicated
        through our own virtual logs; answered once they are durable here. An index chunk
        (a segment the dead broker had adopted) is adopted again (``_adopt_index``)."""
        self._check_epoch(meta)
        self._check_lease()
        waits: dict[Replicator, int] = {}
        claim: dict = {}
        placed = dup = 0
        for i, (h, off) in enumerate(chunk.scan(payload)):
            sl = self.streamlets.get((h.stream_id, h.streamlet))
            if sl is None or not sl.recovering:
                raise NotOwner(f"stream {h.stream_id} streamlet {h.streamlet} is not being recovered here")
            mv = payload[off:off + h.size]
            try:
                if h.flags & chunk.INDEX:
                    ix = index_chunk.parse(mv, h)
                    done = self._adopt_index(sl, h, mv, ix)
                    if done is None:
                        dup += 1
                        continue
                    vlog, idx, seg = done
                    sl.note_adopted(ix.producers())
                    claim.update(dict.fromkeys(seg.foreign))
                    waits[vlog] = idx
                    placed += 1
                    continue
                if h.flags & chunk.CLOSE:  # the group was closed: nothing is placed
                    g = mark(sl, h.group)
                    if g is not None:  # recorded again in our vlog, after the group's chunks
                        vlog, idx = self._append_close(sl, g, VlogChunk(bytes(mv)), h.body_checksum)
                        waits[vlog] = idx
                    dup += 1
                    continue
                g, seg = sl.place(mv, h.producer_id, h.group, h.segment, h.offset)
            except KeraError as e:  # DataLoss: a hole before it; refused, never stored past it
                e.index = i  # which chunk of the request: the backup knows its offset
                log.error("recovery: %s; chunk refused", e)
                raise
            if seg is None:
                dup += 1
                continue
            vlog = self.vlog_for(self.streams[h.stream_id], h.streamlet, g)
            idx = vlog.append(seg, h.offset, h.size, h.body_checksum)
            sl.note_producer(h.producer_id, h.sequence, vlog, idx)
            waits[vlog] = sl.tails[vlog] = idx
            placed += 1
        await self.claims.claim(claim)
        return await self._acked_when_durable(waits, {"placed": placed, "duplicates": dup})

    async def rpc_adopt(self, meta, payload):
        """Recovery re-points a dead broker's settled segments here as evicted segments: the
        payload holds one index chunk per segment (``kera.index_chunk``), in group order.
        Answered once each adoption is durable in our own vlogs and its foreign vsegs are
        claimed on their backups, so neither a failure of ours nor a reclaim loses them."""
        self._check_epoch(meta)
        self._check_lease()
        todo = []
        for h, off in chunk.scan(payload):  # all checked before anything changes
            sl = self.streamlets.get((h.stream_id, h.streamlet))
            if sl is None or not sl.recovering:
                raise NotOwner(f"stream {h.stream_id} streamlet {h.streamlet} is not being recovered here")
            try:
                mv = payload[off:off + h.size]
                todo.append((sl, h, mv, index_chunk.parse(mv, h)))
            except ProtocolError as e:
                raise InvalidArgument(f"adopt takes index chunks: {e}") from None
        waits: dict[Replicator, int] = {}
        claim: dict = {}
        adopted = 0
        rows: dict[Streamlet, list] = {}
        try:
            for sl, h, mv, ix in todo:
                done = self._adopt_index(sl, h, mv, ix)
                if done is not None:
                    vlog, idx, seg = done
                    waits[vlog] = max(idx, waits.get(vlog, 0))
                    claim.update(dict.fromkeys(seg.foreign))
                    rows.setdefault(sl, []).append(ix.rows)
                    adopted += 1
        finally:  # one pass per streamlet over every adopted segment's rows
            for sl, rs in rows.items():
                sl.note_adopted(index_chunk.highest_sequences(np.concatenate(rs)))
        await self.claims.claim(claim)
        await self._acked_when_durable(waits, {})
        for v in waits:  # later chunks go to a new vseg: this one is released with the adoptions
            if v.log.close_open():
                v.poke()
        return {"adopted": adopted}

    def _adopt_index(self, sl: Streamlet, h, data, ix):
        """Adopt the segment ``ix`` describes and append its index chunk (``data``, header
        ``h``) to the group's own vlog: (vlog, ref, segment), None if the group holds the
        segment already."""
        g = sl.groups.get(h.group)
        if g is not None and h.segment < len(g.segments):
            if h.flags & chunk.CLOSE:
                mark(sl, h.group)
            seg = g.segments[h.segment]
            if not isinstance(seg, AdoptedSegment):
                return None
            # adopted by an earlier try whose answer was lost or which failed later: claimed
            # again, and answered once what that try appended is durable
            vlog = self.vlog_for(self.streams[h.stream_id], h.streamlet, g)
            return vlog, vlog.log.appended, seg
        seg = adopted_segment(ix, sl.segment_size, self.claims)
        sl.adopt(h.group, h.producer_id, seg)   # DataLoss past a hole
        if h.flags & chunk.CLOSE:  # the group's last segment: nothing is appended after it
            mark(sl, h.group)
        holder = IndexHolder(bytes(data))
        vlog = self.vlog_for(self.streams[h.stream_id], h.streamlet, sl.groups[h.group])
        idx = vlog.append(holder, 0, holder.head, h.body_checksum)
        self.claims.attach(seg, holder)
        return vlog, idx, seg

    def _check_lease(self) -> None:
        if time.monotonic() > self.lease_until:
            raise Fenced(f"broker {self.broker_id}: no heartbeat answer for too long; not serving")

    # -- produce -------------------------------------------------------------------
    def _streamlet(self, stream_id, index) -> Streamlet:
        sl = self.streamlets.get((stream_id, index))
        if sl is None:
            raise NotOwner(f"stream {stream_id} streamlet {index} is not on broker {self.broker_id}")
        if sl.recovering:
            raise Recovering(f"stream {stream_id} streamlet {index} is being recovered")
        return sl

    def rpc_produce(self, meta, payload):
        if self.fenced:
            raise Fenced("this broker was fenced")
        self._check_lease()
        acks = meta.get("acks", "all")
        if acks not in ("all", "leader", "none"):
            raise InvalidArgument(f"acks must be all, leader or none, not {acks!r}")
        # every checksum verified before anything is stored; header fields as arrays
        heads, offs = chunk.scan_headers(payload)
        self.requests += 1
        errors = []
        placed = [] if meta.get("positions") else None  # [chunk, group, segment, offset], when asked
        waits: dict[Replicator, int] = {}
        streams, streamlets = self.streams, self.streamlets
        reset = chunk.SEQ_RESET
        for i, (sid, index, producer, seq, flags, off, size, checksum) in enumerate(zip(
                heads["stream_id"].tolist(), heads["streamlet"].tolist(), heads["producer_id"].tolist(),
                heads["sequence"].tolist(), heads["flags"].tolist(), offs,
                (heads["body_len"] + chunk.HEADER_SIZE).tolist(), heads["body_checksum"].tolist(),
                strict=True)):
            try:
                if flags & BROKER_FLAGS:
                    raise _broker_flags(flags)
                sl = streamlets.get((sid, index))
                if sl is None or sl.recovering:
                    sl = self._streamlet(sid, index)  # raises the right error
                st = sl.check_sequence(producer, seq, flags & reset)
                if st is not None:  # a resend of a chunk already appended: acked once it is durable
                    for v, ref in st.waits():
                        if waits.get(v, 0) < ref:
                            waits[v] = ref
                    continue
                g, seg, soff = sl.append(payload[off:off + size], producer)
                chunk.place(seg.view, soff, g.id, seg.id, soff)
                if placed is not None:
                    placed.append((i, g.id, seg.id, soff))
                vlog = g.vlog or self.vlog_for(streams[sid], index, g)
                idx = vlog.append(seg, soff, size, checksum)
                sl.note_producer(producer, seq, vlog, idx, seg, soff + size)
                waits[vlog] = sl.tails[vlog] = idx
                sl.plain_last = sl.appended_chunks
            except KeraError as e:
                errors.append([i, e.code])
        result = {"errors": errors} if placed is None else {"errors": errors, "placed": placed}
        if acks != "all" or not waits:
            return result
        return self._acked_when_durable(waits, result)

    # -- compare-and-append: a streamlet as one linearizable register sequence -----------------
    async def rpc_tail(self, meta, payload):
        """A linearizable read's barrier: once everything appended to the streamlet so far is
        durable, its durable end positions and a ``token`` naming that state for ``append_if``.
        Served only under a live lease, so no successor can have taken writes before it."""
        sl = self._streamlet(meta.get("stream_id"), meta.get("streamlet"))
        self._check_lease()
        token = [self.epoch, sl.appended_chunks]
        for vlog, idx in list(sl.tails.items()):
            await vlog.wait_durable(idx)
        low, groups = sl.latest()
        return {"token": token, "low": low, "groups": groups}

    def rpc_append_if(self, meta, payload):
        """One chunk of one keyed record, appended only if no record with that key (and no
        produced chunk) was appended since the state ``expect`` (a ``tail`` token) names,
        else ``conflict``: the compare-and-set a key-value map's writes need. A write
        decided on a key's state at the token applies to the same state, so writes to
        other keys need not conflict. Answered once durable.

        A resend of a chunk already appended (same producer and sequence, here or before a
        recovery) is acknowledged, not compared: a writer whose answer was lost learns that
        its write landed."""
        if self.fenced:
            raise Fenced("this broker was fenced")
        self._check_lease()
        chunks = chunk.scan(payload)
        if len(chunks) != 1:
            raise InvalidArgument("append_if takes exactly one chunk")
        h, off = chunks[0]
        if h.flags & BROKER_FLAGS:
            raise _broker_flags(h.flags)
        if h.record_count != 1:
            raise InvalidArgument("append_if takes a chunk of exactly one record")
        sl = self._streamlet(h.stream_id, h.streamlet)
        st = sl.check_sequence(h.producer_id, h.sequence, h.flags & chunk.SEQ_RESET)
        if st is not None:
            return self._acked_when_durable(dict(st.waits()), {"duplicate": True})
        key = chunk.ChunkView(payload, off, h).keys()[0] or b""
        expect = meta.get("expect")
        if not (isinstance(expect, list) and len(expect) == 2 and expect[0] == self.epoch
                and isinstance(expect[1], int) and expect[1] >= max(sl.plain_last, sl.key_last.get(key, 0))):
            raise Conflict(f"stream {h.stream_id} streamlet {h.streamlet} changed since {expect}")
        g, seg, soff = sl.append(payload[off:off + h.size], h.producer_id)
        chunk.place(seg.view, soff, g.id, seg.id, soff)
        vlog = g.vlog or self.vlog_for(self.streams[h.stream_id], h.streamlet, g)
        idx = sl.tails[vlog] = vlog.append(seg, soff, h.size, h.body_checksum)
        sl.note_producer(h.producer_id, h.sequence, vlog, idx, seg, soff + h.size)
        sl.key_last[bytes(key)] = sl.appended_chunks
        return self._acked_when_durable({vlog: idx}, {"duplicate": False})

    async def _acked_when_durable(self, waits: dict, reply: dict) -> dict:
        for vlog, idx in waits.items():
            await vlog.wait_durable(idx)
        return reply

    # -- consume ---------------------------------------------------------------------
    async def rpc_pull(self, meta, payload):
        reqs = meta.get("streamlets")
        if not isinstance(reqs, list):
            raise InvalidArgument("pull needs a list of streamlets")
        max_bytes = meta.get("max_bytes", 1 << 20)
        wait = meta.get("max_wait_ms", 0)
        if not isinstance(max_bytes, int) or not isinstance(wait, (int, float)):
            raise InvalidArgument("max_bytes and max_wait_ms must be numbers")
        max_bytes = max(1, min(max_bytes, MAX_PULL_BYTES))
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

    # -- retention, reclaiming, eviction -----------------------------------------------
    def _reclaim_once(self) -> None:
        """One pass: retention frees whole expired segments, vsegs nothing live references are
        released (their backups are told), memory is brought down to the low-water mark."""
        now = time.time()
        for sl in self.streamlets.values():
            if sl.filled and not sl.recovering and (sl.retention_bytes >= 0 or sl.retention_ms >= 0):
                freed = sl.expired(now)
                if freed:
                    self._free(freed)
                if sl.waiting is not None and close_waiting(sl.waiting):
                    sl.waiting.vlog.poke()
        for v in self.vlogs.values():
            if v.log.advance_floor() or v.log.floor > v.trimmed:
                v.poke()
        self.memory.relieve()

    async def _reclaimer(self) -> None:
        while True:
            await trio.sleep(RECLAIM_INTERVAL)
            self._reclaim_once()

    async def _releaser(self) -> None:
        """Claims on foreign vsegs nothing of ours needs any more go (apart from the reclaim
        pass, so a slow backup never delays retention or eviction)."""
        while True:
            await trio.sleep(RECLAIM_INTERVAL)
            await self.claims.release()

    def retention_stats(self) -> dict:
        """Per stream here: retained chunk bytes, evicted bytes, and where each streamlet
        starts (lowest group held, its first segment); with the stream's name and retention,
        so a status needs no listing of every stream."""
        out: dict = {}
        for (sid, i), sl in self.streamlets.items():
            gid, seg, held = sl.start_position()
            evicted = sum(s.head for g in sl.groups.values() for s in g.segments[g.start:] if s.evicted)
            e = out.get(sid)
            if e is None:
                s = self.streams.get(sid) or {}
                e = out[sid] = {"name": s.get("name"), "retention_bytes": s.get("retention_bytes", -1),
                                "retention_ms": s.get("retention_ms", -1),
                                "retained": 0, "evicted": 0, "freed": 0, "starts": {}}
            e["retained"] += held
            e["evicted"] += evicted
            e["freed"] += sl.freed_bytes
            e["starts"][i] = [gid, seg]
        return out

    def stats(self) -> dict:
        vl = []
        for r in self.vlogs.values():
            v = r.log
            vl.append({"vlog": v.id, "replication": v.replication, "appended": v.appended,
                       "durable": v.durable, "lag": v.lag(), "rpcs": v.rpcs,
                       "failures": v.failures, "give_ups": v.give_ups, **v.copies_held(),
                       "trimmed": r.trimmed, "reclaimed": r.reclaimed})
        t = self.tiered
        return {"memory": self.memory.used, "memory_limit": self.memory.limit,
                "evictions": self.memory.evictions, "evicted_bytes": self.memory.evicted_bytes,
                "freed_segments": self.freed_segments, "freed_bytes": self.freed_bytes,
                "tiered_reads": t.reads if t else 0, "tiered_bytes": t.bytes if t else 0,
                "tiered_seconds": round(t.seconds, 3) if t else 0.0,
                "tiered_cache": t.cached if t else 0,
                "foreign_vsegs": len(self.claims.vsegs) if self.claims else 0,
                "foreign_released": self.claims.released if self.claims else 0,
                "chunks": sum(s.appended_chunks for s in self.streamlets.values()),
                "bytes": sum(s.appended_bytes for s in self.streamlets.values()),
                "streamlets": len(self.streamlets), "requests": self.requests, "vlogs": vl,
                "compaction": self.compactor.stats()}

    def rpc_vsegs(self, meta, payload):
        """Every virtual segment with its size and the backups holding it (the broker's belief)."""
        return {"broker": self.broker_id, "vsegs": [
            [v.log.id, vs.id, vs.size, vs.closed, sorted(vs.copies), v.log.replication]
            for v in self.vlogs.values() for vs in v.log.vsegs]}

    def rpc_stats(self, meta, payload):
        out = {"broker": self.broker_id, **self.stats()}
        if meta.get("streams"):
            out["streams"] = self.retention_stats()
        return out

    # -- membership ------------------------------------------------------------------
    async def _register(self) -> None:
        delay = 0.05
        while True:
            try:
                r, _ = await self.coord.call("register", {
                    "role": "broker", "addr": self.addr, "node": self.node, "id": self.broker_id,
                    "epoch": self.epoch or None,  # claimed back after a coordinator restart
                }, timeout=5)
                break
            except KeraError as e:
                log.info("coordinator not reachable yet: %s", e)
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
        self.broker_id, self.epoch = r["id"], r["epoch"]
        self.heartbeat = r.get("heartbeat", HEARTBEAT)
        self.lease = r.get("lease", 3 * HEARTBEAT)
        self.lease_until = time.monotonic() + self.lease
        metafile.save(self.id_path, {"id": self.broker_id})

    async def _heartbeats(self) -> None:
        while True:
            sent = time.monotonic()
            try:
                r, _ = await self.coord.call("heartbeat", {
                    "role": "broker", "id": self.broker_id, "epoch": self.epoch,
                    "stats": self.stats()}, timeout=5)
                self.lease_until = sent + self.lease
                self._set_backups(r.get("backups") or [])
            except UnknownMember:
                # the coordinator restarted: rejoin as this incarnation, keeping every streamlet
                epoch = self.epoch
                await self._register()
                if self.epoch != epoch:
                    log.error("broker %d could not rejoin as epoch %d (got %d): its state is gone",
                              self.broker_id, epoch, self.epoch)
                    self.fenced = True
                    raise Fenced(f"epoch {epoch} was not taken back") from None
                log.warning("broker %d rejoined a restarted coordinator as epoch %d", self.broker_id, epoch)
                continue
            except Fenced:
                self.fenced = True
                raise
            except KeraError as e:
                log.warning("heartbeat failed: %s", e)
            await trio.sleep(self.heartbeat)

    def _set_backups(self, live: list[dict]) -> None:
        """Membership from a heartbeat answer: a backup gone or restarted is replaced at once."""
        new = {b["id"]: b for b in live}
        if new.keys() == self.backups.keys() and all(
                new[k]["addr"] == self.backups[k]["addr"] and new[k]["epoch"] == self.backups[k]["epoch"]
                for k in new):
            return
        self.backups = new
        changed = self.backup_set.set_live({b: (v["node"], v["epoch"]) for b, v in new.items()})
        log.info("live backups: %s", sorted(new))
        for b in changed:
            log.warning("backup %d gone or restarted: its copies are made again", b)
        for v in self.vlogs.values():
            v.poke()

    def _reset(self) -> None:
        """Forget everything: a fenced incarnation's streamlets now live elsewhere."""
        self.streams.clear()
        self.streamlets.clear()
        self.memory.used = 0
        self.memory.resident.clear()
        if self.tiered is not None:
            self.tiered.cache.clear()
            self.tiered.cached = 0
        self.vlogs.clear()
        self.claims = Claims(self.pool, lambda: (self.broker_id, self.epoch), self.backup_addr)
        self.mapping.turn = 0
        self.backups.clear()
        self.backup_set.set_live({})
        self.fenced = False
        self.lease_until = 0.0
        self.epoch = 0  # a new incarnation follows: nothing to claim back

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.pool = Pool(nursery)
            self.coord = CoordinatorLink(self.pool, self.coordinator)
            self.claims = Claims(self.pool, lambda: (self.broker_id, self.epoch), self.backup_addr)
            self.tiered = TieredReader(self.pool, lambda: self.broker_id, self.backup_addr,
                                       min(TIERED_CACHE, max(1 << 20, self.memory.limit // 8))
                                       if self.memory.limit else TIERED_CACHE)
            bound = await nursery.start(self.serve, host, port)
            self.addr = f"{host}:{bound}"
            while True:
                await self._register()
                print(f"broker {self.broker_id} listening on {self.addr} (epoch {self.epoch})", flush=True)
                task_status.started(bound)
                task_status = trio.TASK_STATUS_IGNORED
                try:
                    # one incarnation: its vlogs' replicators and its heartbeats
                    async with trio.open_nursery() as incarnation:
                        self.nursery = incarnation
                        incarnation.start_soon(self._heartbeats)
                        incarnation.start_soon(self._reclaimer)
                        incarnation.start_soon(self._releaser)
                        incarnation.start_soon(self.compactor.run)
                except* Fenced:
                    log.error("broker %d epoch %d fenced: dropping its state, joining again",
                              self.broker_id, self.epoch)
                self._reset()


def _broker_flags(flags: int) -> InvalidArgument:
    """A client's chunk flagged as only brokers flag theirs: stored, it would be taken for an
    index or close chunk (or compacted one) by a recovery or a reader."""
    return InvalidArgument(f"chunk flags {flags:#x}: INDEX, CLOSE and COMPACTED are set by brokers "
                           f"only, never in a produced chunk")


def _vseg_size(text: str) -> int:
    n = int(text)
    if not 0 < n <= limits.MAX_VSEG_SIZE:
        raise argparse.ArgumentTypeError(f"must be 1..MAX_VSEG_SIZE ({limits.MAX_VSEG_SIZE}), not {n}")
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kera broker")
    ap.add_argument("--coordinator", default=os.environ.get("KERA_COORDINATOR", "127.0.0.1:7700"))
    ap.add_argument("--data", default="kera-data/broker")
    ap.add_argument("--node", default="")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--vlogs", type=int, default=4, help="virtual logs per broker (shared policy)")
    ap.add_argument("--vlog-policy", default="shared", choices=["shared", "per-stream", "per-group"])
    ap.add_argument("--vseg-size", type=_vseg_size, default=limits.DEFAULT_VSEG_SIZE,
                    help=f"virtual segment capacity, bytes (at most MAX_VSEG_SIZE, {limits.MAX_VSEG_SIZE})")
    ap.add_argument("--memory", type=int, default=None,
                    help="bytes of segments this broker keeps in memory; older replicated ones are "
                         "evicted and read back from backups (default: a quarter of the machine's "
                         "RAM; 0: no limit)")
    ap.add_argument("--replicate-timeout", type=float, default=5.0,
                    help="seconds before a silent backup is replaced")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s broker %(levelname)s %(message)s")
    svc = BrokerService(args.coordinator, args.data, args.node or f"{os.uname().nodename}-{os.getpid()}",
                        VlogMapping(args.vlog_policy, args.vlogs), args.vseg_size,
                        args.replicate_timeout,
                        default_budget() if args.memory is None else args.memory)

    from ..process import run_until_signal
    run_until_signal(svc.run, args.host, args.port)
