"""The cluster's users and ACLs, kept by the coordinator.

They live in the cluster metadata (the embedded log or etcd: ``users`` maps a name to
its salted SCRAM keys, never a password; ``acls`` lists the ACLs; ``security_version``
moves with every change), are held by the coordinator's gate, and are pushed to every
live broker and backup before a change is answered, so that a user added or an ACL
granted works on the next connection anywhere. A member that missed a push (down,
restarted) gets the state with its registration or in its next heartbeat's answer: its
heartbeats say which version it holds. The set is small (a change sends all of it:
thousands of ACLs are a few hundred KiB), so no change log is kept.
"""

from __future__ import annotations

import logging

import trio

from ..errors import InvalidArgument, KeraError
from .acl import Acl
from .mechanisms import check_credentials

log = logging.getLogger("kera.coordinator")

PUSH_TIMEOUT = 5.0


class Accounts:
    """``store``: the coordinator's metadata store (``state``, ``set``, ``delete``);
    ``commit()``: until what was set is durable; ``members()``: the live brokers' and
    backups' addresses; ``pool()``: the coordinator's pool."""

    def __init__(self, store, gate, commit, members, pool):
        self.store, self.gate, self.commit, self.members, self.pool = store, gate, commit, members, pool
        meta = store.state
        for key, empty in (("users", {}), ("acls", []), ("security_version", 0)):
            if key not in meta:   # metadata of a cluster made before users existed
                store.set((key,), empty)
        supers = sorted(gate.super_users)
        if meta.get("super_users", []) != supers:   # this coordinator was started with others
            store.set(("super_users",), supers)
            store.set(("security_version",), meta["security_version"] + 1)
        gate.replace(meta["security_version"], dict(meta["users"]),
                     [Acl.from_wire(a) for a in meta["acls"]])

    async def _changed(self) -> None:
        """Record the change, make it durable, and push it to every live member."""
        meta = self.store.state
        self.store.set(("security_version",), meta["security_version"] + 1)
        self.gate.replace(meta["security_version"], dict(meta["users"]),
                          [Acl.from_wire(a) for a in meta["acls"]])
        await self.commit()
        state = self.gate.state()

        async def one(addr):
            try:
                await self.pool().call(addr, "security", state, timeout=PUSH_TIMEOUT)
            except KeraError as e:   # it gets it with its next heartbeat's answer
                log.warning("users and ACLs not pushed to %s: %s", addr, e)

        async with trio.open_nursery() as n:
            for addr in self.members():
                n.start_soon(one, addr)

    # -- users ---------------------------------------------------------------------------
    async def user_add(self, meta) -> dict:
        """Add a user, or replace its keys (the caller salted them: no password is sent)."""
        try:
            creds = check_credentials(meta["credentials"])
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        self.store.set(("users", meta["name"]), creds)
        await self._changed()
        log.info("user %s: keys for %s", meta["name"], ", ".join(sorted(creds)))
        return {}

    async def user_delete(self, meta) -> dict:
        if meta["name"] not in self.store.state["users"]:
            raise InvalidArgument(f"no user named {meta['name']!r}")
        self.store.delete(("users", meta["name"]))
        await self._changed()
        log.info("user %s deleted", meta["name"])
        return {}

    def user_list(self, meta) -> dict:
        return {"users": [[n, sorted(c)] for n, c in sorted(self.store.state["users"].items())]}

    # -- ACLs ------------------------------------------------------------------------------
    @staticmethod
    def _acl(meta) -> Acl:
        try:
            return Acl.from_wire(meta["acl"])
        except ValueError as e:
            raise InvalidArgument(str(e)) from None

    async def acl_add(self, meta) -> dict:
        a = self._acl(meta)
        acls = self.store.state["acls"]
        if a.to_wire() in acls:
            return {"added": 0}
        self.store.set(("acls",), [*acls, a.to_wire()])
        await self._changed()
        log.info("ACL added: %s", a)
        return {"added": 1}

    async def acl_remove(self, meta) -> dict:
        a = self._acl(meta).to_wire()
        acls = self.store.state["acls"]
        if a not in acls:
            return {"removed": 0}
        self.store.set(("acls",), [x for x in acls if x != a])
        await self._changed()
        log.info("ACL removed: %s", Acl(*a))
        return {"removed": 1}

    def acl_list(self, meta) -> dict:
        p = meta.get("principal")
        return {"acls": [a for a in self.store.state["acls"] if p is None or a[0] == p]}

    def heartbeat(self, version) -> dict:
        """What a member's heartbeat answer carries: the state, if it holds another version."""
        return {} if version == self.gate.version else {"security": self.gate.state()}
