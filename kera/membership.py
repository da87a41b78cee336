"""Membership: who is alive, at which epoch, and who is declared dead.

A mixin of the coordinator, kept apart because it is soft state: servers
register, then heartbeat; one that misses heartbeats for ``dead_after``
seconds is declared dead. Each registration gets a fresh epoch (or claims its
own back after the coordinator changed, see ``_rejoin``), and requests
carrying an older epoch are refused (fencing). It uses the coordinator's
``meta``/``log`` (ids, epochs, fences, known backups) and ``pool``.
"""

from __future__ import annotations

import logging
import time

import trio

from .errors import Fenced, InvalidArgument, KeraError, Unavailable, UnknownMember

log = logging.getLogger("kera.coordinator")


class Member:
    __slots__ = ("role", "id", "addr", "node", "epoch", "last_seen", "alive", "stats", "holds",
                 "recovered", "damage")

    def __init__(self, role, id, addr, node, epoch):
        self.role, self.id, self.addr, self.node, self.epoch = role, id, addr, node, epoch
        self.last_seen = time.monotonic()
        self.alive = True
        self.stats = {}
        self.holds = []
        self.recovered = None   # a backup: the version of the recovered list it applied
        self.damage = 0         # a backup: corrupt chunks it found on its disk, this incarnation

    def describe(self) -> dict:
        out = {"id": self.id, "addr": self.addr, "node": self.node, "epoch": self.epoch,
               "alive": self.alive}
        if self.role == "backup":   # brokers ask a backup what it holds when this moves
            out["damage"] = self.damage
        return out


class Membership:
    """Registration, heartbeats, failure detection and readiness (see the module doc)."""

    async def rpc_register(self, meta, payload):
        role = meta.get("role")
        if role not in self.members:
            raise InvalidArgument(f"unknown role {role!r}")
        addr, node = meta.get("addr"), str(meta.get("node") or "")
        if not isinstance(addr, str):
            raise InvalidArgument("register needs addr")
        mid = meta.get("id")
        if not isinstance(mid, int) or mid <= 0:
            mid = self.meta["next_id"][role]
            self.log.set(("next_id", role), mid + 1)
        elif mid >= self.meta["next_id"][role]:
            self.log.set(("next_id", role), mid + 1)
        epoch = self._rejoin(role, mid, meta.get("epoch"))
        if epoch is None:
            epoch = self._take("next_epoch")
        if role == "backup" and mid not in self.meta["backups"]:
            self.log.set(("backups",), [*self.meta["backups"], mid])
        m = Member(role, mid, addr, node, epoch)
        m.holds = meta.get("holds") or []
        self.members[role][mid] = m
        log.info("%s %d registered at %s (node %s, epoch %d)", role, mid, addr, node, epoch)
        self._notify()
        await self.commit()   # its id and epoch are never handed out again
        out = {"id": mid, "epoch": epoch, "heartbeat": self.dead_after / 4,
               "lease": self.lease, "fences": self.meta["fences"]}
        if role == "backup":
            out.update(self.recovered.answer(m, meta.get("recovered")))
        return out

    def _rejoin(self, role: str, mid: int, epoch) -> int | None:
        """The incarnation a server claims back after this coordinator restarted, if it may.

        A coordinator restart is not a cluster reset: a broker that kept its
        data re-registers as the same incarnation, and its streamlets are not
        recovered. The claim is refused once this coordinator knows of the
        server (it was declared dead or registered anew) or fenced that epoch.
        """
        if not isinstance(epoch, int) or not 0 < epoch < self.meta["next_epoch"]:
            return None
        known = self.members[role].get(mid)
        if known is not None and not (known.alive and known.epoch == epoch):
            return None
        if role == "broker" and self.meta["fences"].get(str(mid), 0) >= epoch:
            return None
        return epoch

    def _member(self, meta) -> Member:
        role, mid, epoch = meta.get("role"), meta.get("id"), meta.get("epoch")
        m = self.members.get(role, {}).get(mid)
        if m is None and isinstance(mid, int) and role in self.members:
            raise UnknownMember(f"{role} {mid} is not known here (the coordinator restarted): "
                                "register again with your epoch")
        if m is None or m.epoch != epoch or not m.alive:
            raise Fenced(f"{role} {mid} epoch {epoch} is not current: register again")
        return m

    def rpc_heartbeat(self, meta, payload):
        m = self._member(meta)
        m.last_seen = time.monotonic()
        if isinstance(meta.get("stats"), dict):
            m.stats = meta["stats"]
        if m.role == "backup":
            if type(meta.get("damage")) is int:
                m.damage = meta["damage"]
            return {"fences": self.meta["fences"], **self.recovered.answer(m, meta.get("recovered"))}
        return {"backups": self._live("backup")}

    async def rpc_suspect(self, meta, payload):
        """A client could not reach a broker: declared dead now only if its heartbeats also
        stopped for longer than a lease and a ping fails too (one slow answer on a loaded
        machine is no evidence)."""
        addr = meta.get("addr")
        m = next((m for m in self.members["broker"].values() if m.alive and m.addr == addr), None)
        if m is None:
            return {"alive": False}
        if time.monotonic() - m.last_seen <= self.lease:
            return {"alive": True}
        try:
            await self.pool.call(m.addr, "ping", {}, timeout=min(1.0, self.dead_after / 2))
            return {"alive": True}
        except KeraError:
            self._declare_dead(m)
            return {"alive": False}

    def _declare_dead(self, m: Member) -> None:
        if m.alive:
            m.alive = False
            log.warning("%s %d at %s declared dead", m.role, m.id, m.addr)
            self._notify()

    def _live(self, role) -> list[dict]:
        return [m.describe() for m in self.members[role].values() if m.alive]

    def _complete_nodes(self) -> int:
        """Nodes with a live broker and a live backup."""
        def nodes(role):
            return {m.node for m in self.members[role].values() if m.alive}
        return len(nodes("broker") & nodes("backup"))

    async def wait_ready(self, timeout: float = 30.0) -> None:
        with trio.move_on_after(timeout):
            while not self.ready:
                await self.changed.wait()
        if not self.ready:
            raise Unavailable(f"cluster starting: {self._complete_nodes()} of {self.expect_nodes} nodes up")

    def _notify(self) -> None:
        if not self.ready and self._complete_nodes() >= self.expect_nodes:
            self.ready = True
        self.changed.set()
        self.changed = trio.Event()

    notify = _notify

    async def watch(self) -> None:
        """Failure detector: declare dead whoever stopped heartbeating.

        Time this coordinator itself was stalled (its event loop blocked, the
        machine overloaded) is not held against the others: their last
        heartbeat is moved forward by the stall.
        """
        period = self.dead_after / 4
        while True:
            before = time.monotonic()
            await trio.sleep(period)
            now = time.monotonic()
            stall = now - before - period
            if stall > period:
                log.warning("coordinator stalled %.2f s: not counted against heartbeats", stall)
                for role in self.members:
                    for m in self.members[role].values():
                        m.last_seen += stall
            for role in self.members:
                for m in self.members[role].values():
                    if m.alive and now - m.last_seen > self.dead_after:
                        self._declare_dead(m)

    def _nodes(self) -> set[str]:
        return {m.node for role in self.members for m in self.members[role].values() if m.alive}

    def live_broker(self, bid: int, epoch: int | None = None) -> Member | None:
        """The broker if it is alive (and, given an epoch, still that incarnation)."""
        m = self.members["broker"].get(bid)
        if m is None or not m.alive or (epoch is not None and m.epoch != epoch):
            return None
        return m

