"""What a pool's connections present to the servers they open (``kera.rpc.Pool``).

Nothing (an anonymous client, where user authentication is off), a member's proof of
the cluster secret with its role and id, or a user's login (SCRAM or PLAIN); and, for
TLS listeners, the context to open TLS with. A member without an id yet (its first
registration) gets one later: ``set_id`` makes the pool open its connections again as
that member (``generation`` moved), so that each names what it is.
"""

from __future__ import annotations

import ssl

from . import secret as secrets_
from .mechanisms import MemberClient, client_mechanism


class Credentials:
    def __init__(self, *, member_key: bytes | None = None, role: str = "", mid: int | None = None,
                 mechanism: str = "", user: str = "", password: str = "",
                 tls: ssl.SSLContext | None = None):
        self.member_key, self.role, self.id = member_key, role, mid
        self.sasl = (mechanism, user, password) if mechanism else None
        self.tls = tls
        self.generation = 0

    @classmethod
    def member(cls, cluster_secret: bytes, role: str, mid: int | None = None,
               tls: ssl.SSLContext | None = None) -> Credentials:
        return cls(member_key=secrets_.derive(cluster_secret, "member"), role=role, mid=mid, tls=tls)

    def set_id(self, mid: int) -> None:
        if mid != self.id:
            self.id = mid
            self.generation += 1

    def mechanism(self):
        """A fresh client side of the mechanism to authenticate with, None: none."""
        if self.member_key is not None:
            return MemberClient(self.member_key, self.role, self.id)
        if self.sasl is not None:
            return client_mechanism(*self.sasl)
        return None


ANONYMOUS = Credentials()
