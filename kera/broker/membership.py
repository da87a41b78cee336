"""The broker's membership: registration, heartbeats (its lease), live backups, fencing.

A heartbeat answer renews the lease under which the broker serves writes and names
the live backups (a backup gone or restarted is replaced at once in every vlog); a
fenced incarnation forgets its state (``_reset``) and registers again.
"""

from __future__ import annotations

import logging
import time

import trio

from .. import metafile
from ..errors import Fenced, KeraError, UnknownMember
from .adopted import Claims

log = logging.getLogger("kera.broker")

HEARTBEAT = 0.5


class Membership:
    """``BrokerService``'s link to the coordinator (its state: ids, epoch, lease, backups)."""

    async def _register(self) -> None:
        delay = 0.05
        while True:
            try:
                r, _ = await self.coord.call("register", {
                    "role": "broker", "addr": self.addr, "node": self.node, "id": self.broker_id,
                    "epoch": self.epoch or None,  # claimed back after a coordinator restart
                    "auth": self.gate.auth,
                    **({"kafka": self.kafka.addr} if self.kafka is not None else {})}, timeout=5)
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

    async def _heartbeats(self) -> None:
        while True:
            sent = time.monotonic()
            try:
                r, _ = await self.coord.call("heartbeat", {
                    "role": "broker", "id": self.broker_id, "epoch": self.epoch,
                    "stats": self.stats(), "security": self.gate.version}, timeout=5)
                self.lease_until = sent + self.lease
                self._set_backups(r.get("backups") or [])
                if r.get("security") is not None:   # a push it missed
                    self.gate.apply(r["security"])
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
        same = new.keys() == self.backups.keys() and all(
            new[k]["addr"] == self.backups[k]["addr"] and new[k]["epoch"] == self.backups[k]["epoch"]
            for k in new)
        if same and all(new[k].get("damage") == self.backups[k].get("damage") for k in new):
            return
        self.backups = new
        if not same:
            changed = self.backup_set.set_live({b: (v["node"], v["epoch"]) for b, v in new.items()})
            log.info("live backups: %s", sorted(new))
            for b in changed:
                log.warning("backup %d gone or restarted: its copies are made again", b)
            for v in self.vlogs.values():
                v.poke()
        if self.rebuilder is not None:   # a backup that found damage on its disk is asked too
            self.rebuilder.poke()

    def _reset(self) -> None:
        """Forget everything: a fenced incarnation's streamlets now live elsewhere."""
        self.streams.clear()
        self.names.clear()
        self.streamlets.clear()
        self.ledger.clear()
        self.memory.used = 0
        self.memory.resident.clear()
        if self.tiered is not None:
            self.tiered.cache.clear()
            self.tiered.cached = 0
        self.vlogs.clear()
        self.unsettled.clear()
        self.claims = Claims(self.pool, lambda: (self.broker_id, self.epoch), self.backup_addr)
        self.mapping.turn = 0
        self.backups.clear()
        self.backup_set.set_live({})
        self.fenced = False
        self.lease_until = 0.0
        self.epoch = 0  # a new incarnation follows: nothing to claim back
