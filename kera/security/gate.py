"""A server's gate: who a connection is (``Peer``) and what it may do (``Gate``).

Every server has a ``Gate``. With the cluster secret it admits members (``KERA-MEMBER``);
with user authentication on (``--auth``) it admits users by SCRAM (PLAIN over TLS only)
and authorizes them by ACLs, and a connection that has not authenticated may only do
so; with it off, a connection that does not authenticate is an anonymous client allowed
every client operation (but none of a member's). The users' stored keys and the ACLs
are the coordinator's (its metadata); brokers and backups keep a copy, replaced when its
version moves (``replace``): nothing is asked per request.

A ``Peer`` is one connection's identity and its cached decisions: a resource is judged
once per connection and ACL version (a stream a client writes to, once per stream id,
so a produce of chunks for 512 streams asks nothing of the ACLs after the first). It also holds the producer ids the connection has
proved it was issued (``bind_producer``): a producer id comes with a token, an HMAC of
(id, principal) under a key derived from the cluster secret, so a chunk under an id
nobody gave this principal is refused by any broker without asking anyone.
"""

from __future__ import annotations

import hashlib
import hmac

from .. import limits
from ..errors import InvalidArgument, Unauthenticated, Unauthorized, UnsupportedMechanism
from ..group_positions import NAME as POSITIONS
from . import secret as secrets_
from .acl import ANONYMOUS, Acl, Authorizer
from .mechanisms import (
    CLIENT,
    MEMBER,
    PLAIN,
    SCRAM,
    Identity,
    MemberServer,
    PlainServer,
    ScramServer,
    check_credentials,
)


class Gate:
    """``cluster_secret``: None only for a server that admits no member (tests of the
    transport); ``auth``: user authentication and ACLs on; ``super_users``: principals
    that bypass ACLs."""

    def __init__(self, cluster_secret: bytes | None, *, auth: bool = False, super_users=()):
        self.member_key = secrets_.derive(cluster_secret, "member") if cluster_secret else None
        self.producer_key = secrets_.derive(cluster_secret or b"", "producer-id")
        self.auth = auth
        self.super_users = frozenset(super_users)
        self.users: dict[str, dict] = {}   # name -> stored keys (mechanisms.credentials)
        self.authorizer = Authorizer(super_users=self.super_users)
        self.version = -1                   # of the users and ACLs held (-1: none yet)

    def replace(self, version: int, users: dict, acls, super_users=None) -> None:
        """The users and ACLs as of ``version`` (the coordinator's, or a copy of them)."""
        if super_users is not None:
            self.super_users = frozenset(super_users)
        self.users = users
        self.authorizer = Authorizer(acls, self.super_users, version)
        self.version = version

    def state(self) -> dict:
        """The users and ACLs as the coordinator sends them to members (``apply``)."""
        return {"version": self.version, "users": self.users,
                "acls": [a.to_wire() for a in self.authorizer.acls],
                "super_users": sorted(self.super_users)}

    def apply(self, state) -> bool:
        """A member takes the coordinator's users and ACLs (pushed, or in a heartbeat
        answer) if newer than what it holds; a malformed state changes nothing."""
        if not isinstance(state, dict) or type(state.get("version")) is not int:
            raise InvalidArgument("a security state is {version, users, acls, super_users}")
        if state["version"] <= self.version:
            return False
        try:
            users = {n: check_credentials(c) for n, c in state["users"].items() if isinstance(n, str)}
            acls = [Acl.from_wire(a) for a in state["acls"]]
            supers = [p for p in state["super_users"] if isinstance(p, str)]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument(f"a malformed security state: {e}") from None
        self.replace(state["version"], users, acls, supers)
        return True

    def peer(self, addr: str, tls: bool = False) -> Peer:
        return Peer(self, addr, tls)

    def mechanism(self, name: str, peer: Peer):
        """The server side of mechanism ``name`` for ``peer``, or ``UnsupportedMechanism``."""
        if name == MEMBER and self.member_key is not None:
            return MemberServer(self.member_key)
        if self.auth and name in SCRAM:
            return ScramServer(name, self.users.get)
        if self.auth and name == PLAIN and peer.tls:
            return PlainServer(self.users.get)
        offered = self.mechanisms(peer)
        why = " (PLAIN only over TLS)" if name == PLAIN and self.auth else \
            " (user authentication is off)" if name in (*SCRAM, PLAIN) else ""
        err = UnsupportedMechanism(f"mechanism {name!r} is not taken here{why}; "
                                   f"taken: {', '.join(offered)}")
        err.mechanisms = ",".join(offered)
        raise err

    def mechanisms(self, peer: Peer) -> list[str]:
        out = [MEMBER] if self.member_key is not None else []
        if self.auth:
            out += [*SCRAM, *([PLAIN] if peer.tls else [])]
        return out

    def producer_token(self, pid: int, principal: str) -> bytes:
        return hmac.new(self.producer_key, f"{pid}/{principal}".encode(), hashlib.sha256).digest()


def take_state(gate: Gate, meta: dict) -> dict:
    """A member's ``security`` RPC: the coordinator pushes its users and ACLs."""
    gate.apply({k: meta[k] for k in ("version", "users", "acls", "super_users")})
    return {}


class Peer:
    """One connection: ``role`` None until it authenticates (CLIENT at once, anonymous,
    when user authentication is off), its member ``id``, its ``principal``."""

    __slots__ = ("gate", "addr", "tls", "role", "id", "principal", "handshake", "producers",
                 "cache", "version")

    def __init__(self, gate: Gate, addr: str, tls: bool):
        self.gate, self.addr, self.tls = gate, addr, tls
        self.role = None if gate.auth else CLIENT
        self.id: int | None = None
        self.principal = ANONYMOUS
        self.handshake = None     # the server mechanism of a handshake under way
        self.producers: set[int] = set()
        self.cache: dict[tuple, bool] = {}
        self.version = -1

    def authenticated(self, who: Identity) -> None:
        self.role, self.id, self.principal = who.role, who.id, who.principal
        self.cache.clear()
        self.producers.clear()

    def may(self, op: str, resource: str, name: str) -> bool:
        """Whether this connection may do ``op`` on the resource; members may do anything a
        client may, and so may everyone while user authentication is off."""
        if self.role != CLIENT or not self.gate.auth:
            return self.role is not None
        az = self.gate.authorizer
        if resource == "stream" and name == POSITIONS:
            # consumer-group positions: a principal allowed on a group reads them (they are
            # positions, never records); a write is checked per record against its group
            resource, name = "group", "*any*"
        key = (op, resource, name)
        got = self.decisions().get(key)
        if got is None:
            got = self.decide(key, az.allowed(self.principal, op, resource, name))
        return got

    def decisions(self) -> dict:
        """The decisions cached for this connection, emptied first if the ACLs changed since
        they were made (a request that checks many resources takes it once)."""
        version = self.gate.authorizer.version
        if self.version != version:
            self.cache.clear()
            self.version = version
        return self.cache

    def decide(self, key, allowed: bool) -> bool:
        """Keep a decision (at most ``ACL_CACHE``: a listing of a million streams starts over)."""
        if len(self.cache) >= limits.ACL_CACHE:
            self.cache.clear()
        self.cache[key] = allowed
        return allowed

    def require(self, op: str, resource: str, name: str) -> None:
        if not self.may(op, resource, name):
            if self.role is None:
                raise Unauthenticated("authenticate first")
            raise Unauthorized(f"{self.principal} may not {op} {resource} {name!r}")

    def bind_producer(self, pid, token) -> None:
        """This connection writes as producer ``pid``: ``token`` must be the one issued with
        it to this principal (checked once per connection and id)."""
        if pid in self.producers:
            return
        if type(pid) is not int or not isinstance(token, bytes) or not hmac.compare_digest(
                token, self.gate.producer_token(pid, self.principal)):
            raise Unauthorized(f"producer id {pid} was not issued to {self.principal} "
                               f"(a producer id is used with the token it was issued with)")
        self.producers.add(pid)
