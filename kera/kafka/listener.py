"""The Kafka listener of a broker: connections behind the broker's own door.

Each connection is admitted by the broker's ``Door`` (connection caps per listener and
address, idle, frame, handshake and send deadlines, a reply budget), reads Kafka frames
(``framing``) and answers them in the order they came, as Kafka's protocol requires
(``answers``). Every request of a read is handled before anything else runs, in arrival
order (so a connection's produces append in order and leave in one replication round);
a handler answers at once, with a ``Waiting`` answer settled later without a task (a
produce once durable), or with a coroutine for the part that waits (a Fetch's long poll,
the coordinator). At most ``limits.KAFKA_INFLIGHT`` answers of a connection wait at once; past that
it is not read, and its socket's receive buffer is as small as Kafka's own (``KAFKA_RCVBUF``),
so backpressure reaches the client soon: librdkafka then makes fewer, bigger batches rather
than queueing one-record requests in the kernel.

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
import socket

import trio
from kio.schema.errors import ErrorCode

from ..door import Deadline
from ..errors import ConnectionLimit, KeraError, ProtocolError
from ..limits import KAFKA_INFLIGHT, KAFKA_RCVBUF
from ..rpc.channel import Plain, Tls
from ..rpc.writer import FrameWriter
from ..server import _disconnect, _peer_addr
from . import framing, versions
from .answers import Answers, Drop, Waiting
from .framing import Encoded

log = logging.getLogger("kera.kafka")


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
    values (a dict, an entity or an ``Encoded``), a ``Waiting`` or a coroutine giving them,
    or None for no response (acks=0)."""

    def __init__(self, broker, handlers: dict):
        self.broker = broker
        self.handlers = handlers
        self.addr = ""
        self.requests = 0
        self.connections = 0   # open now
        self.dropped = 0       # connections dropped for what Kafka drops them for

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
        for ls in listeners:   # accepted connections inherit it (the window is sized at the handshake)
            ls.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, KAFKA_RCVBUF)
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
        channel = Plain(stream)
        try:
            tls = self.broker.tls
            if tls is not None:   # kera's own TLS channel (kera.rpc.channel), as its RPCs'
                channel = Tls(stream, tls, server_side=True)
                with trio.fail_after(door.limits.handshake_timeout):
                    await channel.handshake()
            peer = self.broker.gate.peer(addr, tls is not None)
            self.connections += 1
            try:
                await self._serve(channel, Conn(peer, addr))
            finally:
                self.connections -= 1
        except Exception as e:  # noqa: BLE001 (groups included; cancellation still propagates)
            if not _disconnect(e) and not isinstance(e, trio.TooSlowError):
                log.warning("Kafka connection from %s closed after an error", addr, exc_info=e)
        finally:
            door.leave(addr)
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await channel.aclose()

    async def _serve(self, channel, conn: Conn) -> None:
        door = self.broker.door
        lim = door.limits
        decoder = framing.FrameDecoder()
        deadline = Deadline(lim, trio.current_time())
        async with trio.open_nursery() as nursery:
            def drop(why: str) -> None:
                self.dropped += 1
                log.info("Kafka connection from %s dropped: %s", conn.addr, why)
                nursery.cancel_scope.cancel()

            writer = FrameWriter(channel, nursery, lambda why: nursery.cancel_scope.cancel(),
                                 lim.send_timeout, lim.reply_budget)
            answers = Answers(writer, drop, KAFKA_INFLIGHT)
            nursery.start_soon(answers.run)
            try:
                with trio.CancelScope() as waiting:
                    while True:
                        when, _ = deadline.at(bool(answers.queue), conn.peer.role is not None)
                        waiting.deadline = when
                        data = await channel.receive()
                        waiting.deadline = math.inf
                        if not data:
                            break
                        decoder.feed(data)
                        deadline.active = trio.current_time()
                        await self._handle(conn, decoder, answers, nursery)
                        deadline.frame_since = (deadline.frame_since or deadline.active) \
                            if decoder.pending else None
                if waiting.cancelled_caught:
                    door.stats["idle_cut"] += 1
            except (ProtocolError, Drop) as e:
                drop(str(e))
                return
            answers.close()   # the peer closed: the answers due are written, then it ends

    async def _handle(self, conn: Conn, decoder, answers: Answers, nursery) -> None:
        """Every whole request ``decoder`` holds, handled in order with no scheduling point
        but while ``answers`` is full: a read's appends leave in one replication round, its
        answers in one write. Returns once no whole request is left and there is room (a
        connection at its limit is not read). A flush that makes room is no reason to stop:
        requests left in ``decoder`` would wait for bytes that may never come, from a client
        waiting for their answers (librdkafka then stalls until its request timeout)."""
        while True:
            drained = False
            while not answers.full():
                f = decoder.next()
                if f is None:
                    drained = True
                    break
                self._request(conn, f, answers, nursery)
            answers.flush()
            if answers.full():
                await answers.wait_room()
            elif drained:
                return

    def _request(self, conn: Conn, frame: bytes, answers: Answers, nursery) -> None:
        """Run one request's handler; its answer joins ``answers`` (none for acks=0). ``Drop``
        (or ``ProtocolError``) ends the connection."""
        self.requests += 1
        api_key, version, cid = framing.peek(frame)
        if api_key == versions.API_VERSIONS and not versions.supported(api_key, version):
            body = versions.api_versions_body(0, ErrorCode.unsupported_version)
            answers.ready(_maker(cid, api_key, 0), body)
            return
        if not versions.supported(api_key, version):
            raise Drop(f"API {api_key} version {version} is not served (correlation id {cid})")
        name = versions.SUPPORTED[api_key][0]
        header = framing.read_header(frame, versions.flexible(api_key, version))
        conn.client_id = header.client_id
        try:
            req, _ = versions.reader(versions.request_class(api_key, version))(frame, header.body)
        except Exception as e:  # noqa: BLE001 (kio raises several types for bad bodies)
            raise Drop(f"{name} v{version} does not parse: {e}") from None
        gate = self.handlers.get("_gate")
        if gate is not None:
            try:
                gate(conn, name)
            except KeraError as e:   # Kafka drops a connection asking before it authenticated
                raise Drop(str(e)) from None
        try:
            out = self.handlers[name](conn, req, version)
        except KeraError as e:
            raise Drop(f"{name} v{version} failed: {e}") from None
        if out is None:
            return
        frame_of = _maker(cid, api_key, version)
        if type(out) is Waiting:
            answers.waiting(frame_of, out)
        elif inspect.iscoroutine(out):
            answers.task(nursery, frame_of, out)
        else:
            answers.ready(frame_of, out)


def _maker(cid: int, api_key: int, version: int):
    """The frame maker of a response: values (a dict), an entity or an ``Encoded`` answer
    in, buffers out."""
    def frame_of(values):
        if isinstance(values, Encoded):
            return values.frame(cid)
        cls = versions.response_class(api_key, version)
        entity = values if not isinstance(values, dict) else versions.make(cls, **values)
        return framing.response(cid, entity, versions.writer(cls),
                                versions.flexible_response_header(api_key, version))
    return frame_of
