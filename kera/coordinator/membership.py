"""Membership: who is alive, at which epoch, and who is declared dead.

The coordinator's ``Roster``, kept apart because it is soft state: servers
register, then heartbeat; one that misses heartbeats for ``dead_after``
seconds is declared dead. Each registration gets a fresh epoch (or claims its
own back after the coordinator changed, see ``_rejoin``), and requests
carrying an older epoch are refused (fencing). It is handed the term's
``Metadata`` (ids, epochs, fences, known backups) and the pool; what an answer
carries besides (fences, users and ACLs, recovered incarnations) the
coordinator adds.

A coordinator that stops hearing from every member at once is more likely
the one cut off than all of them dead: it then declares nobody dead until it
hears from one of them again, and gives the others a fresh ``dead_after``
from then (``watch``). A broker incarnation remembers every backup it was
told is alive (``Member.told``): its copies can only be on those, which is
what a recovery must hear from before it calls the incarnation's log
complete (``kera.recovery.manager``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from ..errors import Fenced, InvalidArgument, KeraError, Unavailable, UnknownMember
from .metadata import Metadata

log = logging.getLogger("kera.coordinator")


class Member:
    __slots__ = ("role", "id", "addr", "node", "epoch", "last_seen", "alive", "stats", "holds",
                 "recovered", "damage", "told", "told_all", "kafka")

    def __init__(self, role, id, addr, node, epoch, told_all: bool = True):
        self.role, self.id, self.addr, self.node, self.epoch = role, id, addr, node, epoch
        self.last_seen = time.monotonic()
        self.alive = True
        self.stats = {}
        self.holds = []
        self.recovered = None   # a backup: the version of the recovered list it applied
        self.damage = 0         # a backup: corrupt chunks it found on its disk, this incarnation
        self.told: set[int] = set()   # a broker: every backup it was told is alive, so may use
        # ``told`` is every backup this incarnation ever heard of: False when it rejoined a
        # coordinator that did not tell it all (a restart, another leader)
        self.told_all = told_all
        self.kafka: str | None = None   # a broker's Kafka listener (HOST:PORT), if it has one

    def describe(self) -> dict:
        out = {"id": self.id, "addr": self.addr, "node": self.node, "epoch": self.epoch,
               "alive": self.alive}
        if self.role == "backup":   # brokers ask a backup what it holds when this moves
            out["damage"] = self.damage
        if self.kafka:
            out["kafka"] = self.kafka
        return out


class Roster:
    """Registration, heartbeats, failure detection and readiness (see the module doc), for one
    term: ``metadata`` the term's, ``auth`` whether users authenticate (every member must run
    alike), ``pool()`` the coordinator's pool (to ping a suspect)."""

    def __init__(self, metadata: Metadata, pool: Callable, *, auth: bool, dead_after: float,
                 expect_nodes: int):
        self.metadata, self.pool, self.auth = metadata, pool, auth
        self.dead_after = dead_after
        self.lease = dead_after * 0.75   # how long a heartbeat answer lets a broker serve
        self.expect_nodes = expect_nodes  # a local cluster's size: not ready before it is complete
        self.members: dict[str, dict[int, Member]] = {"broker": {}, "backup": {}}
        # broker incarnations replaced by a newer registration, kept until recovered
        self.departed: dict[tuple[int, int], Member] = {}
        self.suspect_since: float | None = None   # every member went silent at once (``watch``)
        self.last_heard = time.monotonic()          # from any member
        self.ready = expect_nodes == 0
        self.changed = trio.Event()

    async def register(self, meta) -> tuple[Member, dict]:
        """A member joins (its connection proved it is one, and names the id it asks for:
        none for a new one): its member and what the answer says of it (id, epoch, heartbeat
        period, lease), once its id and epoch are durable. A member that runs with user
        authentication on or off unlike this coordinator is refused."""
        role, addr, node = meta["role"], meta["addr"], meta.get("node") or ""
        if meta.get("auth", self.auth) != self.auth:
            raise InvalidArgument(f"this cluster runs {'with' if self.auth else 'without'} "
                                  f"user authentication (--auth): so must every server")
        md = self.metadata
        mid = meta.get("id")
        if not mid:
            mid = md.state["next_id"][role]
            md.set(("next_id", role), mid + 1)
        elif mid >= md.state["next_id"][role]:
            md.set(("next_id", role), mid + 1)
        epoch = self._rejoin(role, mid, meta.get("epoch"))
        rejoined = epoch is not None
        if epoch is None:
            epoch = md.take("next_epoch")
        if role == "backup" and mid not in md.state["backups"]:
            md.set(("backups",), [*md.state["backups"], mid])
        m = Member(role, mid, addr, node, epoch, told_all=not rejoined)
        m.holds = meta.get("holds") or []
        m.kafka = meta.get("kafka")
        old = self.members[role].get(mid)
        if old is not None and old.epoch == epoch:   # registered again as itself
            m.told, m.told_all = old.told, old.told_all
        elif role == "broker" and old is not None:
            self.departed[(mid, old.epoch)] = old   # its recovery needs what it was told
        self.members[role][mid] = m
        self._heard()
        log.info("%s %d registered at %s (node %s, epoch %d)", role, mid, addr, node, epoch)
        self.notify()
        await md.commit()   # its id and epoch are never handed out again
        return m, {"id": mid, "epoch": epoch, "heartbeat": self.dead_after / 4, "lease": self.lease}

    def _rejoin(self, role: str, mid: int, epoch) -> int | None:
        """The incarnation a server claims back after this coordinator restarted, if it may.

        A coordinator restart is not a cluster reset: a broker that kept its
        data re-registers as the same incarnation, and its streamlets are not
        recovered. The claim is refused once this coordinator knows of the
        server (it was declared dead or registered anew) or fenced that epoch.
        """
        state = self.metadata.state
        if not isinstance(epoch, int) or not 0 < epoch < state["next_epoch"]:
            return None
        known = self.members[role].get(mid)
        if known is not None and not (known.alive and known.epoch == epoch):
            return None
        if role == "broker" and state["fences"].get(str(mid), 0) >= epoch:
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

    def heartbeat(self, meta) -> Member:
        """A member is alive (its stats and damage taken): its member, for the answer."""
        m = self._member(meta)
        m.last_seen = time.monotonic()
        self._heard()
        if meta.get("stats") is not None:
            m.stats = meta["stats"]
        if m.role == "backup" and meta.get("damage") is not None:
            m.damage = meta["damage"]
        return m

    def tell_backups(self, m: Member) -> list[dict]:
        """The live backups, as told to broker ``m``: remembered as backups it may use."""
        live = self._live("backup")
        m.told.update(b["id"] for b in live)
        return live

    def incarnation(self, bid: int, epoch: int) -> Member | None:
        """Broker ``bid``'s incarnation ``epoch`` as this coordinator last knew it: its member,
        or the one a newer registration replaced (dead or not); None if never seen here."""
        m = self.members["broker"].get(bid)
        if m is not None and m.epoch == epoch:
            return m
        return self.departed.get((bid, epoch))

    async def suspect(self, meta) -> dict:
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
            await self.pool().call(m.addr, "ping", {}, timeout=min(1.0, self.dead_after / 2))
            return {"alive": True}
        except KeraError:
            self._declare_dead(m)
            return {"alive": False}

    def _declare_dead(self, m: Member) -> None:
        if m.alive:
            m.alive = False
            log.warning("%s %d at %s declared dead", m.role, m.id, m.addr)
            self.notify()

    def _live(self, role) -> list[dict]:
        return [m.describe() for m in self.members[role].values() if m.alive]

    def complete_nodes(self) -> int:
        """Nodes with a live broker and a live backup."""
        def nodes(role):
            return {m.node for m in self.members[role].values() if m.alive}
        return len(nodes("broker") & nodes("backup"))

    async def wait_ready(self, timeout: float = 30.0) -> None:
        with trio.move_on_after(timeout):
            while not self.ready:
                await self.changed.wait()
        if not self.ready:
            raise Unavailable(f"cluster starting: {self.complete_nodes()} of {self.expect_nodes} nodes up")

    def notify(self) -> None:
        """Something changed (a member came or went, a recovery ended): whoever waits looks again."""
        if not self.ready and self.complete_nodes() >= self.expect_nodes:
            self.ready = True
        self.changed.set()
        self.changed = trio.Event()

    async def watch(self) -> None:
        """Failure detector: declare dead whoever stopped heartbeating.

        Time this coordinator itself was stalled (its event loop blocked, the
        machine overloaded) is not held against the others: their last
        heartbeat is moved forward by the stall. Nor is a silence of every
        member at once (see ``_overdue``).
        """
        period = self.dead_after / 4
        while True:
            before = time.monotonic()
            await trio.sleep(period)
            now = time.monotonic()
            stall = now - before - period
            if stall > period:
                log.warning("coordinator stalled %.2f s: not counted against heartbeats", stall)
                self.last_heard += stall
                for role in self.members:
                    for m in self.members[role].values():
                        m.last_seen += stall
            for m in self._overdue(now):
                self._declare_dead(m)

    def _overdue(self, now: float) -> list[Member]:
        """The live members to declare dead now: silent for longer than ``dead_after``, unless
        this coordinator hears nobody at all (no member for ``dead_after / 2``, two heartbeats):
        then it is more likely cut off from them than all of them dead at once, and it
        suspects itself first, declaring nobody dead until it hears from a member again
        (``_heard``). Declaring them would gain nothing: with no broker or no backup heard
        from, no recovery can run, and at the heal every healthy broker would be fenced and
        recovered. A lone member's silence says nothing about this coordinator: it is judged
        by its own heartbeats."""
        live = [m for role in self.members for m in self.members[role].values() if m.alive]
        late = [m for m in live if now - m.last_seen > self.dead_after]
        if len(live) > 1 and late and now - self.last_heard > self.dead_after / 2:
            if self.suspect_since is None:
                self.suspect_since = now
                log.warning("every member went silent at once (nothing heard for %.1f s): this "
                            "coordinator is more likely cut off than all of them dead; declaring "
                            "none dead until one is heard from", now - self.last_heard)
            return []
        return late

    def _heard(self) -> None:
        """A member was heard from: a coordinator that suspected itself is reachable again, and
        the members still silent get a whole ``dead_after`` from now before they are declared
        dead (they were silent because of this coordinator, not for long of their own)."""
        now = self.last_heard = time.monotonic()
        if self.suspect_since is None:
            return
        log.warning("heard from a member after %.1f s of silence from all: no longer suspecting "
                    "this coordinator", now - self.suspect_since)
        self.suspect_since = None
        for role in self.members:
            for m in self.members[role].values():
                if m.alive:
                    m.last_seen = max(m.last_seen, now)

    def nodes(self) -> set[str]:
        return {m.node for role in self.members for m in self.members[role].values() if m.alive}

    def live(self, role: str) -> list[Member]:
        """The live members of ``role``."""
        return [m for m in self.members[role].values() if m.alive]

    def addrs(self) -> list[str]:
        """The live brokers' and backups' addresses."""
        return [m.addr for role in ("broker", "backup") for m in self.live(role)]

    def forget(self, keep: Callable[[tuple[int, int]], bool]) -> None:
        """Drop the replaced broker incarnations not to ``keep`` (recovered, or owning nothing)."""
        for key in [k for k in self.departed if not keep(k)]:
            del self.departed[key]

    def live_broker(self, bid: int, epoch: int | None = None) -> Member | None:
        """The broker if it is alive (and, given an epoch, still that incarnation)."""
        m = self.members["broker"].get(bid)
        if m is None or not m.alive or (epoch is not None and m.epoch != epoch):
            return None
        return m

