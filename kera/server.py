"""The serving side of the transport: one task per connection, requests admitted by the
wire table before their handler runs.

Requests are read in order; a handler ``rpc_<name>`` that is a plain function runs
right there, in arrival order (appends keep their order), and may return a coroutine
for the part that waits, which runs concurrently in the connection's nursery, or a
``Later`` that whoever settles it answers (a produce's durability, settled by the
replication's outcomes: no task per request). A bounded number of requests per
connection may be in flight; past that the connection stops being read (backpressure).

Before a handler runs, its server's table (``kera.wire``) admits the request: the
caller (the connection's ``Peer``: who it authenticated as, ``kera.security.gate``),
then the fields. A method missing from the table is unknown. What a connection may
hold is bounded at the door (``kera.door``): connections per listener and address, its
idle, frame, handshake and send deadlines, its queued replies, and the bytes of large
frames still arriving on all connections.
"""

from __future__ import annotations

import inspect
import logging
import math
import socket
import ssl
from functools import partial

import trio

from . import frame, wire
from .door import Deadline, Door
from .errors import (
    AuthenticationFailed,
    ConnectionLimit,
    InvalidArgument,
    KeraError,
    PeerTooSlow,
    ProtocolError,
    Unauthorized,
    UnknownMethod,
)
from .limits import MAX_FRAME
from .rpc import MAX_INFLIGHT, RECV_SIZE, FrameWriter, Later, error_frame, result_frame
from .security.acl import ANONYMOUS
from .security.gate import Gate
from .security.mechanisms import CLIENT, Identity
from .security.tls import peer_principal

log = logging.getLogger("kera.rpc")

_CUT = {"idle_cut": "idle for longer than the idle timeout",
        "frame_cut": "a request did not arrive whole within the frame timeout",
        "handshake_cut": "did not authenticate within the handshake timeout",
        "send_cut": "did not take its replies within the send timeout",
        "budget_cut": "left more replies unread than its byte budget"}


def _disconnect(e: BaseException) -> bool:
    """A peer that went away (possibly inside a group): nothing to report."""
    if isinstance(e, BaseExceptionGroup):
        return all(_disconnect(x) for x in e.exceptions)
    return isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, OSError))


def _peer_addr(stream) -> str:
    try:
        return str(_socket(stream).getpeername()[0])
    except (OSError, AttributeError, IndexError):
        return "?"


def _socket(stream):
    return stream.socket if hasattr(stream, "socket") else stream.transport_stream.socket


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
        try:
            if self.tls is not None:
                tls = await self._tls(stream)
                if tls is None:
                    return
                stream = tls
            await self._serve_connection(stream, self._peer(stream, addr))
        except Exception as e:  # noqa: BLE001 (groups included; cancellation still propagates)
            if not _disconnect(e):
                log.warning("connection closed after an error", exc_info=e)
        finally:
            door.leave(addr)
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()

    def _peer(self, stream, addr: str):
        """A new connection's ``Peer``: on TLS, a verified client certificate names its user
        (with user authentication on)."""
        peer = self.gate.peer(addr, self.tls is not None)
        if self.tls is not None and self.gate.auth:
            principal = peer_principal(stream)
            if principal is not None:
                peer.authenticated(Identity(CLIENT, None, principal))
        return peer

    async def _tls(self, stream):
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
            tls = trio.SSLStream(stream, self.tls, server_side=True, https_compatible=True)
            try:
                await tls.do_handshake()
                return tls
            except trio.BrokenResourceError as e:
                door.stats["tls_refused"] += 1
                log.info("TLS handshake with %s failed: %s", _peer_addr(stream), e.__cause__ or e)
                return None
        door.stats["handshake_cut"] += 1
        return None

    async def _serve_connection(self, stream, peer) -> None:
        door = self.door
        lim = door.limits
        decoder = frame.FrameDecoder(self.max_frame)
        slots = trio.Semaphore(MAX_INFLIGHT)
        live = True
        cut: list[str] = []          # why the door cut the connection
        held = 0                     # bytes of a large frame counted in door.receiving
        deadline = Deadline(lim, trio.current_time())

        def broken(why: str) -> None:
            """The writer failed (a send error, its deadline, its budget): the connection ends."""
            if why in _CUT and not cut:
                cut.append(why)
                door.stats[why] += 1
            nursery.cancel_scope.cancel()

        def answer(rid: int, result) -> None:
            """A ``Later``'s answer, from whoever settled it: written at once if the socket is
            free and takes it, else by a task of this connection (a failed write: the reader
            sees the connection end)."""
            slots.release()
            if not live:
                return
            try:
                if isinstance(result, Exception):
                    raise result
                out = result_frame(rid, result)
            except Exception as e:
                out = error_frame(rid, e)
            if not writer.now(out):
                writer.queue(out)   # after the frame being written

        async def finish(rid: int, coro) -> None:
            try:
                try:
                    out = result_frame(rid, await coro)
                except (KeraError, Exception) as e:
                    out = error_frame(rid, e)
                await writer.send(out)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                slots.release()

        try:
            async with trio.open_nursery() as nursery:
                writer = FrameWriter(stream, nursery, broken, lim.send_timeout, lim.reply_budget)
                with trio.CancelScope() as waiting:
                    try:
                        while True:
                            when, why = deadline.at(slots.value < MAX_INFLIGHT or writer.busy,
                                                    peer.role is not None)
                            waiting.deadline = when
                            if held and door.receiving >= lim.receive_budget:
                                await door.room()
                            data = await stream.receive_some(RECV_SIZE)
                            waiting.deadline = math.inf
                            if not data:
                                if decoder.pending:  # a client whose send was cut: never a request
                                    log.info("connection closed inside a frame (%d bytes dropped)",
                                             decoder.pending)
                                break
                            decoder.feed(data)
                            now = deadline.active = trio.current_time()
                            while (f := decoder.next()) is not None:
                                if f.kind != frame.REQUEST:
                                    raise ProtocolError("expected a request frame")
                                try:  # no scheduling point while requests are queued: appends batch up
                                    slots.acquire_nowait()
                                except trio.WouldBlock:
                                    await slots.acquire()
                                try:
                                    rpc, fn = self.lookup(f.meta.get("m"))
                                    try:
                                        rpc.admit(peer, f.meta)
                                    except KeraError:
                                        door.stats["requests_refused"] += 1
                                        raise
                                    res = fn(f.meta, f.payload, peer) if rpc.peer else fn(f.meta, f.payload)
                                    if inspect.iscoroutine(res):
                                        nursery.start_soon(finish, f.request_id, res)
                                        continue
                                    if type(res) is Later:
                                        res._bind(partial(answer, f.request_id))
                                        continue
                                    out = result_frame(f.request_id, res)  # a reply too large: its error
                                except AuthenticationFailed as e:
                                    door.stats["auth_failed"] += 1
                                    slots.release()
                                    with trio.move_on_after(1):
                                        await writer.send(error_frame(f.request_id, e))
                                    nursery.cancel_scope.cancel()
                                    return   # a failed handshake ends the connection
                                except Exception as e:
                                    out = error_frame(f.request_id, e)
                                slots.release()
                                await writer.send(out)
                            deadline.frame_since = (deadline.frame_since or now) if decoder.pending else None
                            if decoder.gathered != held:
                                door.hold(decoder.gathered - held)
                                held = decoder.gathered
                    except ProtocolError as e:
                        # garbage: say why (best effort), then drop this connection only
                        with trio.move_on_after(1):
                            await writer.send(error_frame(0, e))
                if waiting.cancelled_caught:
                    cut.append(why)
                    door.stats[why] += 1
                    writer.now(error_frame(0, PeerTooSlow(f"connection closed: {_CUT[why]}")))
                live = False
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            live = False
            if held:
                door.hold(-held)
