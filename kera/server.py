"""The base of every server: its RPC table's handlers, the handshake RPC, and its listener,
whose connections are taken in at the door (``kera.door``: caps per listener and address),
through TLS when the server has a certificate, and served (``kera.rpc.served``: each request
admitted by the wire table before its handler runs).

Before a handler runs, its server's table (``kera.wire``) admits the request: the caller
(the connection's ``Peer``: who it authenticated as, ``kera.security.gate``), then the
fields. A method missing from the table is unknown.
"""

from __future__ import annotations

import logging
import socket
import ssl

import trio

from . import frame, wire
from .door import Door
from .errors import (
    AuthenticationFailed,
    ConnectionLimit,
    InvalidArgument,
    ProtocolError,
    Unauthorized,
    UnknownMethod,
)
from .limits import MAX_FRAME
from .rpc.answers import error_frame
from .rpc.channel import Plain, Tls
from .rpc.served import Served
from .security.acl import ANONYMOUS
from .security.gate import Gate
from .security.mechanisms import CLIENT, Identity
from .security.tls import peer_principal

log = logging.getLogger("kera.rpc")


def _disconnect(e: BaseException) -> bool:
    """A peer that went away (possibly inside a group): nothing to report."""
    if isinstance(e, BaseExceptionGroup):
        return all(_disconnect(x) for x in e.exceptions)
    return isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, OSError))


def _peer_addr(stream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, AttributeError, IndexError):
        return "?"


class Service:
    """Base for servers: subclasses define ``rpc_<method>`` for each entry of ``rpcs`` (their
    server's table) and set ``gate`` (who is admitted) and ``door`` (what connections may
    hold)."""

    max_frame = MAX_FRAME
    rpcs: dict[str, wire.Rpc] = {}
    gate: Gate | None = None
    door: Door | None = None
    tls: ssl.SSLContext | None = None   # set: the listener speaks TLS only

    def _handlers(self) -> dict:
        h = self.__dict__.get("_handler_map")
        if h is None:
            h = self._handler_map = {name: (rpc, getattr(self, f"rpc_{name}"))
                                     for name, rpc in self.rpcs.items()}
        return h

    def lookup(self, method) -> tuple[wire.Rpc, object]:
        """The table's entry and the handler of ``method``; ``UnknownMethod`` if it has none."""
        h = self._handlers().get(method) if type(method) is str else None
        if h is None:
            raise UnknownMethod(f"unknown method {method!r}")
        return h

    # -- the handshake (every server) ------------------------------------------------
    def rpc_authenticate(self, meta, payload, peer):
        """One message of a handshake (``kera.security.mechanisms``): the first names the
        mechanism. Answers the server's next message and whether it is done; a failure
        closes the connection."""
        if peer.handshake is None:
            if peer.role is not None and peer.principal != ANONYMOUS:
                raise Unauthorized(f"this connection is authenticated already, as {peer.principal}")
            if meta.get("mechanism") is None:
                raise InvalidArgument("a handshake's first message names its mechanism")
            peer.handshake = self.gate.mechanism(meta["mechanism"], peer)
        elif meta.get("mechanism") is not None:
            raise InvalidArgument("a handshake names its mechanism in its first message only")
        try:
            out, who = peer.handshake.step(meta["auth_bytes"])
        except AuthenticationFailed:
            peer.handshake = None
            raise
        if who is None:
            return {"auth_bytes": out, "done": False}
        peer.handshake = None
        peer.authenticated(who)
        return {"auth_bytes": out, "done": True}

    # -- connections -------------------------------------------------------------------
    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.gate is None:
            self.gate = Gate(None)
        if self.door is None:
            self.door = Door()
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.serve_connection, listeners)

    async def serve_connection(self, stream) -> None:
        """One client connection. Whatever goes wrong here ends this connection only."""
        door, addr = self.door, _peer_addr(stream)
        try:
            door.enter(addr)
        except ConnectionLimit as e:
            with trio.move_on_after(1):
                await stream.send_all(error_frame(0, e))
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()
            return
        channel = Plain(stream)
        try:
            if self.tls is not None:
                channel = await self._tls(stream)
                if channel is None:
                    return
            await Served(channel, self._peer(channel, addr), door, self.lookup, self.max_frame).run()
        except Exception as e:  # noqa: BLE001 (groups included; cancellation still propagates)
            if not _disconnect(e):
                log.warning("connection closed after an error", exc_info=e)
        finally:
            door.leave(addr)
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await (channel or Plain(stream)).aclose()

    def _peer(self, channel, addr: str):
        """A new connection's ``Peer``: on TLS, a verified client certificate names its user
        (with user authentication on)."""
        peer = self.gate.peer(addr, self.tls is not None)
        if self.tls is not None and self.gate.auth:
            principal = peer_principal(channel)
            if principal is not None:
                peer.authenticated(Identity(CLIENT, None, principal))
        return peer

    async def _tls(self, stream) -> Tls | None:
        """TLS on an accepted connection: its handshake within the handshake timeout, or
        None (the connection is closed). A peer that speaks our frames in the clear is told,
        in the clear, that this listener takes TLS only."""
        door = self.door
        with trio.move_on_after(door.limits.handshake_timeout):
            head = await stream.socket.recv(2, socket.MSG_PEEK)
            if head == frame.MAGIC:
                door.stats["tls_refused"] += 1
                await stream.send_all(error_frame(0, ProtocolError(
                    "this listener takes TLS only: connect with security.protocol SSL or SASL_SSL")))
                return None
            tls = Tls(stream, self.tls, server_side=True)
            try:
                await tls.handshake()
                return tls
            except trio.BrokenResourceError as e:
                door.stats["tls_refused"] += 1
                log.info("TLS handshake with %s failed: %s", _peer_addr(stream), e.__cause__ or e)
                return None
        door.stats["handshake_cut"] += 1
        return None
