"""Replicator: drives one pure ``VirtualLog`` with trio and the broker's RPC pool.

The vlog decides what to send and what an answer means; this task only
sends, waits for answers, timers and new appends, and wakes the producers
whose chunks became durable. Each replicate runs in this task's nursery, so
an incarnation's end cancels them all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from ..errors import Fenced, KeraError
from ..rpc import Pool
from ..vlog import VirtualLog
from ..vlog.virtual_log import Send

log = logging.getLogger("kera.vlog")


class Replicator:
    """A broker's virtual log with its replication task."""

    def __init__(self, vlog: VirtualLog, pool: Pool, identity: Callable[[], tuple[int, int]],
                 addr_of: Callable[[int], str], on_durable: Callable[[], None],
                 live_backups: Callable[[], list] = list):
        self.log = vlog
        self.live_backups = live_backups  # [(backup id, addr)]: where released vsegs are trimmed
        self.trimmed = 0      # floor every live backup was told of
        self.trimming = False
        self.reclaimed = 0    # file bytes backups reported deleted for this vlog
        self.pool = pool
        self.identity = identity      # (broker id, epoch) named in every replicate
        self.addr_of = addr_of        # backup id -> address
        self.on_durable = on_durable  # the broker's pulls look again
        self.wake = trio.Event()
        self.durable_changed = trio.Event()

    @property
    def id(self) -> int:
        return self.log.id

    def append(self, segment, offset: int, length: int, body_checksum: int) -> int:
        idx = self.log.append(segment, offset, length, body_checksum)
        vs = self.log.open
        segment.noted(self, vs, vs.size - length)  # where a backup will hold it
        self.wake.set()
        return idx

    async def _trim(self) -> None:
        """Tell every live backup that this vlog's vsegs below the floor hold nothing live:
        each records the floor (so a recovery knows they were released, not lost) and
        deletes its files of them. Retried after a failure."""
        floor = self.log.floor
        broker, _ = self.identity()
        ok = [True]

        async def one(addr):
            try:
                r, _ = await self.pool.call(addr, "trim", {"broker": broker, "vlog": self.log.id,
                                                           "floor": floor}, timeout=self.log.timeout)
                self.reclaimed += int(r.get("bytes", 0))
            except KeraError as e:
                ok[0] = False
                log.info("vlog %d: trim to vseg %d on %s failed: %s", self.log.id, floor, addr, e)

        try:
            async with trio.open_nursery() as n:
                for _, addr in self.live_backups():
                    n.start_soon(one, addr)
            if ok[0]:
                self.trimmed = max(self.trimmed, floor)
            else:
                await trio.sleep(1.0)
        finally:
            self.trimming = False
            self.wake.set()

    async def wait_durable(self, index: int) -> None:
        while self.log.durable < index:
            await self.durable_changed.wait()

    def poke(self) -> None:
        """Membership changed: look again."""
        self.wake.set()

    def _moved(self) -> None:
        self.durable_changed.set()
        self.durable_changed = trio.Event()
        self.on_durable()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                self.wake = trio.Event()
                # let requests already received append first: they leave in this round
                await trio.sleep(0)
                for s in self.log.poll(trio.current_time()):
                    nursery.start_soon(self._send, s)
                if self.log.floor > self.trimmed and not self.trimming:
                    self.trimming = True
                    nursery.start_soon(self._trim)
                if self.log.fenced:
                    raise Fenced(f"vlog {self.log.id}: a backup says this incarnation is fenced")
                deadline = self.log.next_deadline(trio.current_time())
                with trio.move_on_at(math.inf if deadline is None else deadline):
                    await self.wake.wait()

    async def _send(self, s: Send) -> None:
        broker, epoch = self.identity()
        meta = {"broker": broker, "epoch": epoch, "vlog": self.log.id, "vseg": s.vseg.id,
                "offset": s.offset, "close": s.close}
        v = self.log
        try:
            r, _ = await self.pool.call(self.addr_of(s.backup), "replicate", meta, parts=s.parts(),
                                        timeout=v.timeout)
            moved = v.on_reply(s.token, int(r["length"]), trio.current_time())
        except Fenced:
            moved = v.on_error(s.token, trio.current_time(), fenced=True)
        except KeraError as e:
            length = getattr(e, "length", None)
            if length is None:
                log.warning("vlog %d vseg %d: backup %d failed: %s", v.id, s.vseg.id, s.backup, e)
            moved = v.on_error(s.token, trio.current_time(),
                               length=length if isinstance(length, int) else None)
        if moved:
            self._moved()
        self.wake.set()
