"""The broker's membership: registration, heartbeats (its lease), fencing.

A heartbeat answer renews the lease under which the broker serves writes and names
the live backups (handed on: a backup gone or restarted is replaced at once in every
vlog); a fenced incarnation forgets its state (the service's ``_reset``) and registers
again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from .. import metafile
from ..coordinator.link import CoordinatorLink
from ..errors import Fenced, KeraError, UnknownMember
from ..security.credentials import Credentials
from ..security.gate import Gate

log = logging.getLogger("kera.broker")

HEARTBEAT = 0.5


class Membership:
    """The broker's incarnation as the coordinator knows it: it owns the broker's id and
    epoch, the lease and whether it is fenced. Handed the file keeping the id
    (``id_path``), the connections' ``credentials`` (which take the id), the ``gate``
    (users and ACLs a register or heartbeat answer carries), what a register says of us
    (``hello``: address, node, Kafka listener), what a heartbeat reports (``stats``) and
    where the live backups it names go (``on_backups``); the coordinator's link once the
    broker runs (``coord``)."""

    def __init__(self, id_path: str, credentials: Credentials, gate: Gate, *,
                 hello: Callable[[], dict], stats: Callable[[], dict],
                 on_backups: Callable[[list], None]):
        self.id_path, self.credentials, self.gate = id_path, credentials, gate
        self.hello, self.stats, self.on_backups = hello, stats, on_backups
        self.coord: CoordinatorLink | None = None
        self.broker_id: int | None = (metafile.load(id_path) or {}).get("id")
        self.epoch = 0
        self.fenced = False
        self.heartbeat = HEARTBEAT
        self.lease = 0.0           # seconds a heartbeat answer lets us serve
        self.lease_until = 0.0     # monotonic time our lease ends

    def check_epoch(self, meta) -> None:
        if self.fenced or meta.get("epoch") != self.epoch:
            raise Fenced(f"broker {self.broker_id} is at epoch {self.epoch}, request for {meta.get('epoch')}")

    def check_lease(self) -> None:
        if time.monotonic() > self.lease_until:
            raise Fenced(f"broker {self.broker_id}: no heartbeat answer for too long; not serving")

    def reset(self) -> None:
        """A new incarnation follows: nothing to claim back, no lease yet."""
        self.fenced = False
        self.lease_until = 0.0
        self.epoch = 0

    async def register(self) -> None:
        delay = 0.05
        while True:
            try:
                r, _ = await self.coord.call("register", {
                    "role": "broker", **self.hello(), "id": self.broker_id,
                    "epoch": self.epoch or None,  # claimed back after a coordinator restart
                    "auth": self.gate.auth}, timeout=5)
                break
            except KeraError as e:
                log.info("coordinator not reachable yet: %s", e)
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
        self.broker_id, self.epoch = r["id"], r["epoch"]
        self.credentials.set_id(self.broker_id)   # our connections open again, as this broker
        if r.get("security") is not None:
            self.gate.apply(r["security"])
        self.heartbeat = r.get("heartbeat", HEARTBEAT)
        self.lease = r.get("lease", 3 * HEARTBEAT)
        self.lease_until = time.monotonic() + self.lease
        metafile.save(self.id_path, {"id": self.broker_id})

    async def heartbeats(self) -> None:
        while True:
            sent = time.monotonic()
            try:
                r, _ = await self.coord.call("heartbeat", {
                    "role": "broker", "id": self.broker_id, "epoch": self.epoch,
                    "stats": self.stats(), "security": self.gate.version}, timeout=5)
                self.lease_until = sent + self.lease
                self.on_backups(r.get("backups") or [])
                if r.get("security") is not None:   # a push it missed
                    self.gate.apply(r["security"])
            except UnknownMember:
                # the coordinator restarted: rejoin as this incarnation, keeping every streamlet
                epoch = self.epoch
                await self.register()
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
            took = time.monotonic() - sent
            if took > self.lease / 2:
                log.warning("heartbeat answered after %.2f s (lease %.2f s)", took, self.lease)
            await trio.sleep(self.heartbeat)
            late = time.monotonic() - sent - took - self.heartbeat
            if late > self.heartbeat:
                log.warning("event loop stalled %.2f s: heartbeat late", late)
