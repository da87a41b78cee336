"""The Kafka listener of a broker: connections behind the broker's own door.

Each connection is admitted by the broker's ``Door`` (connection caps per listener and
address, idle, frame, handshake and send deadlines, a reply budget), reads Kafka frames
(``framing``) and answers them in the order they came, as Kafka's protocol requires:
a handler runs at once, in arrival order (so a connection's produces append in order),
and may return a coroutine for the part that waits (acks=all, a Fetch's long poll); a
sender writes the answers in order. At most ``MAX_INFLIGHT`` requests of a connection wait
at once; past that it is not read (backpressure).

What Kafka drops a connection for is dropped here: a frame of an impossible size, an API
it does not know, a version out of range (except ApiVersions, answered
``UNSUPPORTED_VERSION`` with the versions served, as Kafka answers it), a request whose
body does not parse. Every other error is an error code in the answer and the
connection, and the broker, keep serving.
"""

from __future__ import annotations

import inspect
import logging
import math

import trio
from kio.schema.errors import ErrorCode

from ..door import Deadline
from ..errors import ConnectionLimit, KeraError, ProtocolError
from ..rpc import FrameWriter
from ..server import _disconnect, _peer_addr
from . import framing, versions

log = logging.getLogger("kera.kafka")

MAX_INFLIGHT = 64      # requests of one connection answered or waiting at once
RECV_SIZE = 1 << 20


class Conn:
    """One Kafka connection: its peer (who it authenticated as) and what it negotiated."""

    __slots__ = ("peer", "client_id", "sasl", "addr")

    def __init__(self, peer, addr: str):
        self.peer = peer
        self.addr = addr
        self.client_id: str | None = None
        self.sasl = None        # the mechanism a SaslHandshake chose, until authenticated


class KafkaListener:
    """``handlers``: API name -> ``fn(conn, request, version)`` returning the response's
    values (a dict), a coroutine giving them, or None for no response (acks=0)."""

    def __init__(self, broker, handlers: dict):
        self.broker = broker
        self.handlers = handlers
        self.addr = ""
        self.requests = 0
        self.dropped = 0       # connections dropped for what Kafka drops them for

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.connection, listeners)

    async def connection(self, stream) -> None:
        door, addr = self.broker.door, _peer_addr(stream)
        try:
            door.enter(addr)
        except ConnectionLimit:
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()
            return
        try:
            tls = self.broker.tls
            if tls is not None:
                stream = trio.SSLStream(stream, tls, server_side=True, https_compatible=True)
                with trio.fail_after(door.limits.handshake_timeout):
                    await stream.do_handshake()
            peer = self.broker.gate.peer(addr, tls is not None)
            await self._serve(stream, Conn(peer, addr))
        except Exception as e:  # noqa: BLE001 (groups included; cancellation still propagates)
            if not _disconnect(e) and not isinstance(e, trio.TooSlowError):
                log.warning("Kafka connection from %s closed after an error", addr, exc_info=e)
        finally:
            door.leave(addr)
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()

    async def _serve(self, stream, conn: Conn) -> None:
        door = self.broker.door
        lim = door.limits
        decoder = framing.FrameDecoder()
        send, receive = trio.open_memory_channel(MAX_INFLIGHT)
        deadline = Deadline(lim, trio.current_time())
        async with trio.open_nursery() as nursery:
            writer = FrameWriter(stream, nursery, lambda why: nursery.cancel_scope.cancel(),
                                 lim.send_timeout, lim.reply_budget)
            nursery.start_soon(self._sender, receive, writer)
            try:
                with trio.CancelScope() as waiting:
                    while True:
                        when, _ = deadline.at(send.statistics().current_buffer_used > 0,
                                              conn.peer.role is not None)
                        waiting.deadline = when
                        data = await stream.receive_some(RECV_SIZE)
                        waiting.deadline = math.inf
                        if not data:
                            break
                        decoder.feed(data)
                        deadline.active = trio.current_time()
                        while (f := decoder.next()) is not None:
                            slot = self._request(conn, f)
                            if slot is None:
                                continue
                            if inspect.iscoroutine(slot[1]):
                                ready = Slot(slot[0])
                                nursery.start_soon(ready.run, slot[1])
                                await send.send(ready)
                            else:
                                await send.send(slot)
                        deadline.frame_since = (deadline.frame_since or deadline.active) \
                            if decoder.pending else None
                if waiting.cancelled_caught:
                    door.stats["idle_cut"] += 1
            except (ProtocolError, _Drop) as e:
                self.dropped += 1
                log.info("Kafka connection from %s dropped: %s", conn.addr, e)
                nursery.cancel_scope.cancel()
            finally:
                send.close()   # the peer closed: the answers due are sent, then it ends

    async def _sender(self, receive, writer: FrameWriter) -> None:
        async with receive:
            async for item in receive:
                if isinstance(item, Slot):
                    await item.done.wait()
                    item = (item.frame, item.body)
                frame_of, body = item
                if body is None:
                    continue
                try:
                    out = frame_of(body)
                except _Drop as e:
                    self.dropped += 1
                    log.info("Kafka connection dropped: %s", e)
                    return
                await writer.send(out)

    def _request(self, conn: Conn, frame: bytes):
        """Run one request's handler: (frame maker, body or coroutine), or None for no
        answer. ``_Drop`` (or ``ProtocolError``) ends the connection."""
        self.requests += 1
        api_key, version, cid = framing.peek(frame)
        if api_key == versions.API_VERSIONS and not versions.supported(api_key, version):
            body = versions.api_versions_body(0, ErrorCode.unsupported_version)
            return _maker(cid, api_key, 0, body), body
        if not versions.supported(api_key, version):
            raise _Drop(f"API {api_key} version {version} is not served (correlation id {cid})")
        name = versions.SUPPORTED[api_key][0]
        header = framing.read_header(frame, versions.flexible(api_key, version))
        conn.client_id = header.client_id
        try:
            req, _ = versions.reader(versions.request_class(api_key, version))(frame, header.body)
        except Exception as e:  # noqa: BLE001 (kio raises several types for bad bodies)
            raise _Drop(f"{name} v{version} does not parse: {e}") from None
        gate = self.handlers.get("_gate")
        if gate is not None:
            try:
                gate(conn, name)
            except KeraError as e:   # Kafka drops a connection asking before it authenticated
                raise _Drop(str(e)) from None
        try:
            out = self.handlers[name](conn, req, version)
        except KeraError as e:
            raise _Drop(f"{name} v{version} failed: {e}") from None
        if out is None:
            return None
        return _maker(cid, api_key, version), out


class _Drop(Exception):
    """A request Kafka drops the connection for."""


class Slot:
    """An answer still being worked out (a coroutine's), sent in its turn."""

    __slots__ = ("frame", "body", "done")

    def __init__(self, frame_of):
        self.frame = frame_of
        self.body = None
        self.done = trio.Event()

    async def run(self, coro) -> None:
        try:
            self.body = await coro
        except KeraError as e:
            log.info("Kafka request failed: %s", e)
            self.body = e
        finally:
            self.done.set()


def _maker(cid: int, api_key: int, version: int, body=None):
    """The frame maker of a response: values (a dict) or an entity in, buffers out."""
    cls = versions.response_class(api_key, version)
    flexible = versions.flexible_response_header(api_key, version)
    write = versions.writer(cls)

    def frame_of(values):
        if isinstance(values, KeraError):
            raise _Drop(f"no answer: {values}")
        entity = values if not isinstance(values, dict) else versions.make(cls, **values)
        return framing.response(cid, entity, write, flexible)
    return frame_of

