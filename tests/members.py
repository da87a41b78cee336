"""Speaking to servers as the cluster members their internal RPCs are for.

Tests that drive a server's internal RPCs directly (a backup's replicate, trim and claim,
a broker's assign and adopt) open ``open_members(secret)``: each request goes on a pool
authenticated as the member the wire table wants for it (``kera.wire``): its role, and,
for an RPC a member makes only as itself, the id the request names. Client RPCs go as the
coordinator (members may do what clients do).
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import trio

from kera import wire
from kera.rpc import Pool, unwrapped
from kera.security import secret as secret_
from kera.security.credentials import Credentials

SECRET = bytes(range(32))   # the cluster secret of servers a test starts alone


def secret_file(directory, secret: bytes = SECRET) -> str:
    """A cluster secret file in ``directory`` (mode 0600), for servers started alone."""
    path = os.path.join(str(directory), secret_.SECRET_FILE)
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex())
    return path


def _who(method: str, meta: dict) -> tuple[str, int | None]:
    for table in wire.TABLES.values():
        rpc = table.get(method)
        if rpc is not None and isinstance(rpc.caller, wire.Members):
            c = rpc.caller
            role = meta.get(c.role_field) if c.role_field else sorted(c.roles)[-1] \
                if "coordinator" not in c.roles else "coordinator"
            mid = meta.get(c.as_self) if c.as_self else None
            return role, mid if type(mid) is int and mid > 0 else None
    return "coordinator", None


class Members:
    def __init__(self, nursery: trio.Nursery, secret: bytes):
        self.nursery, self.secret = nursery, secret
        self.pools: dict[tuple, Pool] = {}

    def pool(self, role: str, mid: int | None = None) -> Pool:
        p = self.pools.get((role, mid))
        if p is None:
            p = self.pools[(role, mid)] = Pool(self.nursery, credentials=Credentials.member(
                self.secret, role, mid))
        return p

    async def call(self, addr: str, method: str, meta: dict | None = None, payload=b"", **kw):
        return await self.pool(*_who(method, meta or {})).call(addr, method, meta, payload, **kw)

    def drop(self, addr: str) -> None:
        for p in self.pools.values():
            p.drop(addr)

    async def aclose(self) -> None:
        for p in self.pools.values():
            await p.aclose()


@asynccontextmanager
async def open_members(secret=SECRET):
    """``secret``: bytes, a secret file's path, or a ``LocalCluster``."""
    if hasattr(secret, "secret_file"):
        secret = secret.secret_file
    if isinstance(secret, str):
        secret = secret_.load(secret)
    async with unwrapped(), trio.open_nursery() as nursery:
        m = Members(nursery, secret)
        try:
            yield m
        finally:
            await m.aclose()
            nursery.cancel_scope.cancel()
