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
                 addr_of: Callable[[int], str], on_durable: Callable[[], None]):
        self.log = vlog
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
        self.wake.set()
        return idx

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
