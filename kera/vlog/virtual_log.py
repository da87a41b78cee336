"""VirtualLog: a replicated log of chunk references shared by many streamlets.

Appends only record a reference (O(1)); one replicator task per vlog ships
everything appended since its last round to the open virtual segment's R-1
backups, with at most one RPC in flight per backup: chunks that arrive while
an RPC is out leave together in the next one (group commit). The number of
replication RPCs follows the number of rounds, not the number of streams.

A virtual segment becomes durable up to the bytes every one of its backups
acknowledged; virtual segments become durable in order, so each physical
segment's durable head only moves forward. Closed virtual segments that lost
a backup are re-replicated to a new one from broker memory.
"""

from __future__ import annotations

import logging

import trio

from ..errors import KeraError
from .virtual_segment import VirtualSegment

log = logging.getLogger("kera.vlog")

MAX_BATCH_BYTES = 8 << 20
REPLICATE_TIMEOUT = 5.0


class VirtualLog:
    def __init__(self, id: int, replication: int, capacity: int, cluster,
                 timeout: float = REPLICATE_TIMEOUT):
        self.id = id
        self.timeout = timeout
        self.replication = replication
        self.capacity = capacity
        self.cluster = cluster  # broker side: pool, identity, backup choice, durable notification
        self.vsegs: list[VirtualSegment] = []
        self.open: VirtualSegment | None = None
        self.pending: list[VirtualSegment] = []  # vsegs with replication work, by id
        self.appended = 0   # refs appended, ever
        self.durable = 0    # refs on R copies, ever (a prefix)
        self.wake = trio.Event()
        self.durable_changed = trio.Event()
        self.rpcs = 0
        self.replicated_chunks = 0
        self.failures = 0

    # -- broker side: appends and waits ------------------------------------------
    def append(self, segment, offset: int, length: int, body_checksum: int) -> int:
        """Reference a chunk just appended to ``segment``; returns its index in this vlog."""
        vs = self.open
        if vs is None or not vs.has_room(length):
            if vs is not None:
                vs.closed = True  # its close marker still has to reach its backups
                if not vs.queued:
                    self._queue(vs)
            vs = self.open = VirtualSegment(len(self.vsegs), self.capacity)
            self.vsegs.append(vs)
        if not vs.queued:
            self._queue(vs)
        vs.add(segment, offset, length, body_checksum)
        self.appended += 1
        self.wake.set()
        return self.appended

    async def wait_durable(self, index: int) -> None:
        while self.durable < index:
            await self.durable_changed.wait()

    def backup_lost(self, backup_id: int) -> None:
        """A backup died: every virtual segment it held needs a new copy."""
        for vs in self.vsegs:
            if backup_id in vs.copies:
                del vs.copies[backup_id]
                vs.close_sent.discard(backup_id)
                if not vs.queued:
                    self._queue(vs)
        self.wake.set()

    def _queue(self, vs: VirtualSegment) -> None:
        vs.queued = True
        self.pending.append(vs)
        if len(self.pending) > 1 and self.pending[-2].id > vs.id:
            self.pending.sort(key=lambda v: v.id)

    def lag(self) -> int:
        return self.appended - self.durable

    def copies_held(self) -> dict:
        full = sum(1 for vs in self.vsegs if len(vs.copies) >= self.replication - 1)
        return {"vsegs": len(self.vsegs), "fully_replicated": full}

    # -- replicator ---------------------------------------------------------------
    def _done(self, vs: VirtualSegment) -> bool:
        need = self.replication - 1
        if len(vs.copies) < need or vs.durable < len(vs.refs):
            return False
        if any(acked < vs.size for acked in vs.copies.values()):
            return False
        return not vs.closed or vs.close_sent >= set(vs.copies)

    async def run(self) -> None:
        while True:
            while self.pending and self._done(self.pending[0]):
                self.pending.pop(0).queued = False
            if not self.pending:
                await self.wake.wait()
                self.wake = trio.Event()
                # let requests already received append first: they leave in this round
                await trio.sleep(0)
                continue
            self.wake = trio.Event()
            await self._round(self.pending[0])

    async def _round(self, vs: VirtualSegment) -> None:
        need = self.replication - 1
        if need == 0:
            self._advance(vs, len(vs.refs))
            if vs.closed or vs is not self.open:
                vs.close_sent = set()
            return
        if len(vs.copies) < need:
            chosen = self.cluster.choose_backups(vs, need - len(vs.copies))
            for b in chosen:
                vs.copies[b] = 0
            log.info("vlog %d vseg %d: backups %s", self.id, vs.id, sorted(vs.copies))
            if len(vs.copies) < need:
                # not enough backups alive: wait for membership to change (acks=all waits too)
                with trio.move_on_after(0.5):
                    await self.cluster.membership_changed.wait()
                if not chosen:
                    return
        stop = len(vs.refs)
        closing = vs.closed
        sends = []
        for b, acked in vs.copies.items():
            start = vs.index_at(acked)
            end, nbytes = start, 0
            while end < stop and (nbytes == 0 or nbytes + vs.refs[end][2] <= MAX_BATCH_BYTES):
                nbytes += vs.refs[end][2]
                end += 1
            close = closing and end == len(vs.refs) and b not in vs.close_sent
            if end > start or close:
                sends.append((b, acked, start, end, close))
        if not sends:
            return
        results: dict[int, int | None] = {}

        async def send(b, acked, start, end, close):
            meta = {"broker": self.cluster.broker_id, "epoch": self.cluster.epoch, "vlog": self.id,
                    "vseg": vs.id, "offset": acked, "close": close}
            try:
                addr = self.cluster.backup_addr(b)
                r, _ = await self.cluster.pool.call(addr, "replicate", meta, parts=vs.parts(start, end),
                                                     timeout=self.timeout)
                results[b] = (int(r["length"]), close)
            except KeraError as e:
                log.warning("vlog %d vseg %d: backup %d failed: %s", self.id, vs.id, b, e)
                results[b] = None

        async with trio.open_nursery() as n:
            for s in sends:
                n.start_soon(send, *s)
        self.rpcs += len(sends)
        for b, res in results.items():
            if res is None:
                self.failures += 1
                vs.copies.pop(b, None)
                vs.close_sent.discard(b)
                vs.failed.add(b)
                continue
            length, close = res
            if b in vs.copies:
                vs.copies[b] = length
                if close:
                    vs.close_sent.add(b)
        if len(vs.copies) >= need:
            self._advance(vs, vs.index_at(min(vs.copies.values())))

    def _advance(self, vs: VirtualSegment, durable_refs: int) -> None:
        """Refs [vs.durable, durable_refs) are on R copies: move the physical durable heads."""
        if durable_refs <= vs.durable:
            return
        for seg, off, n in vs.refs[vs.durable:durable_refs]:
            seg.durable = off + n
        self.replicated_chunks += durable_refs - vs.durable
        self.durable += durable_refs - vs.durable
        vs.durable = durable_refs
        self.durable_changed.set()
        self.durable_changed = trio.Event()
        self.cluster.notify_durable()
