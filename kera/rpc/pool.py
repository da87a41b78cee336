"""A client's connections, one per address (``Pool``), each presenting the pool's credentials
once when it opens (``kera.security.credentials``: a member's proof, a user's login, or
nothing), before any request; TLS if the credentials say so."""

from __future__ import annotations

import math
from contextlib import asynccontextmanager

import trio

from ..errors import Unavailable
from ..limits import MAX_FRAME
from ..security.credentials import ANONYMOUS, Credentials
from .addresses import parse_addr
from .channel import Plain, Tls
from .connection import Connection, unsent


class Pool:
    """Connections by address, their reader tasks owned by this pool's nursery; each
    presents ``credentials`` once, when it opens."""

    def __init__(self, nursery: trio.Nursery, max_frame: int = MAX_FRAME,
                 connect_timeout: float = 5.0, credentials: Credentials | None = None):
        self.nursery = nursery
        self.max_frame = max_frame
        self.connect_timeout = connect_timeout
        self.credentials = credentials or ANONYMOUS
        self.conns: dict[str, Connection] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def get(self, addr: str, timeout: float | None = None) -> Connection:
        """The open connection to ``addr``, or a new one (within ``connect_timeout``, or
        ``timeout`` if shorter)."""
        c = self.conns.get(addr)
        if c is not None and not c.closed and c.generation == self.credentials.generation:
            return c
        lock = self._locks.setdefault(addr, trio.Lock())
        async with lock:
            c = self.conns.get(addr)
            if c is not None and not c.closed:
                if c.generation == self.credentials.generation:
                    return c
                self.drop(addr)   # opened as what we no longer are (a member given its id)
            c = await self._open(addr, timeout)
            self.conns[addr] = c
            return c

    async def _open(self, addr: str, timeout: float | None = None) -> Connection:
        """A new connection to ``addr``, TLS if the credentials say so, authenticated, within
        ``connect_timeout`` (or ``timeout`` if shorter). A failure here is ``unsent``: no
        request has left yet."""
        creds = self.credentials
        try:
            host, port = parse_addr(addr)
        except ValueError as e:
            raise unsent(Unavailable(f"cannot connect to {addr!r}: {e}")) from None
        limit = min(self.connect_timeout, math.inf if timeout is None else timeout)
        stream = None
        try:
            with trio.fail_after(limit):
                stream = await trio.open_tcp_stream(host, port)
                stream.setsockopt(6, 1, 1)  # TCP_NODELAY
                channel = Plain(stream)
                if creds.tls is not None:
                    channel = Tls(stream, creds.tls, server_side=False, server_hostname=host)
                    await channel.handshake()
        except BaseException as e:
            if stream is not None:
                stream.socket.close()
            if isinstance(e, (OSError, trio.TooSlowError, trio.BrokenResourceError)):
                raise unsent(Unavailable(f"cannot connect to {addr}: {_why(e)}")) from None
            raise
        c = Connection(addr, channel, self.max_frame, self.nursery)
        c.generation = creds.generation
        self.nursery.start_soon(c.reader)
        mech = creds.mechanism()
        if mech is not None:
            try:
                await self._authenticate(c, mech, limit)
            except Unavailable as e:
                c._tear("authentication failed")
                unsent(e)   # no request of the caller's left
                raise
            except BaseException:
                c._tear("authentication failed")
                raise
        return c

    async def _authenticate(self, c: Connection, mech, timeout: float) -> None:
        """The handshake: the mechanism's messages until the server says it is done."""
        meta = {"mechanism": mech.name, "auth_bytes": mech.first()}
        while True:
            r, _ = await c.call("authenticate", meta, timeout=timeout)
            if r.get("done"):
                mech.finish(r.get("auth_bytes", b""))
                return
            meta = {"auth_bytes": mech.step(r.get("auth_bytes", b""))}

    async def call(self, addr: str, method: str, meta: dict | None = None, payload=b"", *,
                   timeout: float | None = None, **kw):
        """``Connection.call`` on ``addr``'s connection; ``timeout`` bounds connecting as well."""
        start = trio.current_time()
        conn = await self.get(addr, timeout)
        if timeout is not None:
            timeout = max(0.0, timeout - (trio.current_time() - start))
        return await conn.call(method, meta, payload, timeout=timeout, **kw)

    def drop(self, addr: str) -> None:
        c = self.conns.pop(addr, None)
        if c is not None:
            c._fail(Unavailable(f"connection to {addr} dropped"))
            self.nursery.start_soon(c.aclose)

    async def aclose(self) -> None:
        for c in list(self.conns.values()):
            await c.aclose()
        self.conns.clear()


def _why(e: BaseException) -> str:
    """A connection failure said plainly (a TLS refusal names its reason)."""
    if isinstance(e, trio.TooSlowError):
        return "timeout"
    cause = e.__cause__ if isinstance(e, trio.BrokenResourceError) and e.__cause__ else e
    return str(cause) or type(cause).__name__


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for e in eg.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


@asynccontextmanager
async def unwrapped():
    """Re-raise a lone error out of nursery exception groups, so that callers of
    our context managers catch ``UnknownStream``, not a group holding it."""
    try:
        yield
    except BaseExceptionGroup as eg:
        leaves = _leaves(eg)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


@asynccontextmanager
async def open_pool(**kw):
    async with unwrapped(), trio.open_nursery() as nursery:
        pool = Pool(nursery, **kw)
        try:
            yield pool
        finally:
            await pool.aclose()
            nursery.cancel_scope.cancel()
