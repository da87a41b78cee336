"""Thin trio transport around the sans-IO frame codec.

Servers: ``serve(service, port)`` runs one task per connection. Requests are
read in order; a service method ``rpc_<name>`` that is a plain function runs
right there, in arrival order (appends keep their order), and may return a
coroutine for the part that waits, which runs concurrently in the
connection's nursery, or a ``Later`` that whoever settles it answers (a
produce's durability, settled by the replication's outcomes: no task per
request). A bounded number of requests per connection may be
in flight; past that the connection stops being read (backpressure).

Clients: ``Pool`` owns one pipelined connection per address and the reader
tasks that match responses to requests by id. A send that was cancelled or
timed out may have left part of a frame on the wire, so its connection is
closed (the next call opens a new one); a reply or error for a request no
longer waited for is dropped and the connection stays, unless nothing at all
came back on it while that request waited and no request sent after it still
waits (that one decides when its own time is up): a peer silent for a whole
timeout is gone or cut off (a partition fails no connection), and its
connection would resume only at the kernel's next retransmission, seconds after
the peer is back, so it is closed and the next call connects afresh.
``Connection.post``
sends a request with no task waiting for it: the reader hands its answer to
a callback.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from contextlib import asynccontextmanager
from functools import partial

import trio

from . import frame, iov
from .errors import KeraError, ProtocolError, Unavailable, UnknownMethod, from_wire
from .limits import MAX_FRAME

log = logging.getLogger("kera.rpc")

MAX_INFLIGHT = 256
RECV_SIZE = 1 << 20
VECTOR_FROM = 1 << 16  # a frame of parts this large goes out vectored (sendmsg), not joined first,
VECTOR_PART = 1 << 12  # when its parts average this much: many tiny parts cost less joined


def unsent(err: Unavailable) -> Unavailable:
    """``err``, marked as raised before any byte of its request left (a failed connect, a
    closed connection): the peer cannot have it, so it may be sent elsewhere or again."""
    err._unsent = True
    return err


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, not {addr!r}")
    return host, int(port)


WILDCARDS = ("", "0.0.0.0", "::")


def advertised(host: str, port: int, advertise: str = "") -> str:
    """The address others reach a server at: ``advertise`` (HOST:PORT, or HOST with the port it
    bound), else the host it binds and that port (127.0.0.1 for a wildcard host, which no peer
    can dial)."""
    if advertise:
        return advertise if ":" in advertise else f"{advertise}:{port}"
    return f"{'127.0.0.1' if host in WILDCARDS else host}:{port}"


def _parts_frame(kind: int, rid: int, meta: dict, parts) -> bytes | list:
    """A frame whose payload is ``parts``: joined when small or of tiny parts, else its buffers
    as they are."""
    bufs = frame.frame_buffers(kind, rid, meta, parts)
    total = sum(map(frame.nbytes, bufs))
    return bufs if total >= VECTOR_FROM and total >= len(bufs) * VECTOR_PART else b"".join(bufs)


def _views(data: bytes | list) -> list[memoryview]:
    return iov.views(data) if isinstance(data, list) else [memoryview(data)]


def _write(sock, vs: list[memoryview], i: int) -> int:
    """Write ``vs[i:]`` while the socket takes it (up to ``iov.IOV_MAX`` buffers a call, each
    call resuming where the last stopped); returns the index of the first buffer not fully
    written (``len(vs)``: all of them)."""
    while i < len(vs):
        try:
            sent = os.writev(sock.fileno(), vs[i:i + iov.IOV_MAX])  # closed: fileno -1, EBADF
        except BlockingIOError:
            return i
        except OSError as e:
            raise trio.BrokenResourceError(f"socket send failed: {e}") from e
        i = iov.advance(vs, i, sent)
    return i


async def _send_rest(sock, vs: list[memoryview], i: int) -> None:
    while (i := _write(sock, vs, i)) < len(vs):
        await trio.lowlevel.wait_writable(sock)


async def send_frame(stream: trio.SocketStream, data: bytes | list) -> None:
    """Send one frame (bytes, or a list of buffers sent vectored: no copy into one buffer),
    written straight to the socket: a frame the kernel takes at once costs one system call
    and no trip through the scheduler; past a full socket buffer it waits until the socket
    is writable. Callers hold the connection's send lock (``_take``)."""
    await _send_rest(stream.socket, _views(data), 0)


async def _take(lock: trio.Semaphore) -> None:
    """Take ``lock``: at once when it is free (no trip through the scheduler), else in turn."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class FrameWriter:
    """A connection's sending side: frames go straight to the socket, one at a time under one
    send lock (a Semaphore, not a Lock: a write begun by one task may be finished by another).
    ``now`` writes a frame from anywhere on the loop (an answer settled by whoever, a posted
    request) without a task when nobody else is sending and the socket takes it; a frame it
    begins but the socket does not take whole is finished by a task of ``nursery``.
    ``broken(why)`` is told when such a write fails."""

    __slots__ = ("sock", "lock", "nursery", "broken", "finishing")

    def __init__(self, sock, nursery: trio.Nursery, broken):
        self.sock = sock
        self.lock = trio.Semaphore(1)
        self.nursery = nursery
        self.broken = broken
        self.finishing = None   # the tag ``now`` was given for the frame a task is finishing

    @property
    def busy(self) -> bool:
        return self.lock.value == 0

    def now(self, data: bytes | list, tag=None) -> bool:
        """Write one frame if nobody is sending: False if someone else is; True once it is
        written, begun and left to a task (``finishing`` is ``tag`` until it ends), or failed
        (``broken`` was told: the connection is done, nothing is left to send)."""
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            return False
        vs = _views(data)
        try:
            i = _write(self.sock, vs, 0)
        except trio.BrokenResourceError as e:
            self.lock.release()
            self.broken(f"send failed: {e}")
            return True
        if i == len(vs):
            self.lock.release()
        else:
            self.finishing = tag
            self.nursery.start_soon(self._rest, vs, i)
        return True

    async def _rest(self, vs: list, i: int) -> None:
        try:
            await _send_rest(self.sock, vs, i)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self.broken(f"send failed: {e}")
        except BaseException as e:
            self.broken(f"send interrupted ({type(e).__name__})")
            raise
        finally:
            self.finishing = None
            self.lock.release()

    async def send(self, data: bytes | list) -> None:
        """Send one frame, in turn."""
        await _take(self.lock)
        try:
            await _send_rest(self.sock, _views(data), 0)
        finally:
            self.lock.release()


class Later:
    """A handler's answer given later, by whoever settles it (``done``), with no task waiting
    for it: the connection writes the answer from there (at once when its socket takes it)."""

    __slots__ = ("_result", "_to")

    def __init__(self):
        self._result = self._to = None

    def done(self, result) -> None:
        """The answer: a result, or an exception (sent as its typed error)."""
        if self._to is not None:
            self._to(result)
        else:
            self._result = (result,)

    def _bind(self, to) -> None:
        if self._result is not None:
            to(self._result[0])
        else:
            self._to = to


def _result_frame(rid: int, result) -> bytes | list:
    if result is None:
        result = {}
    if isinstance(result, tuple):
        meta, payload = result
        if isinstance(payload, list):
            return _parts_frame(frame.RESPONSE, rid, meta, payload)
        return frame.encode(frame.RESPONSE, rid, meta, payload)
    return frame.encode(frame.RESPONSE, rid, result)


def _error_frame(rid: int, err: Exception) -> bytes:
    if isinstance(err, KeraError):
        info = err.to_wire()
    else:
        log.exception("internal error", exc_info=err)
        info = {"code": "internal", "message": f"{type(err).__name__}: {err}"}
    return frame.encode(frame.ERROR, rid, info)


def _disconnect(e: BaseException) -> bool:
    """A peer that went away (possibly inside a group): nothing to report."""
    if isinstance(e, BaseExceptionGroup):
        return all(_disconnect(x) for x in e.exceptions)
    return isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, OSError))


class Service:
    """Base for servers: subclasses define ``rpc_<method>(meta, payload)``."""

    max_frame = MAX_FRAME

    def lookup(self, method):
        fn = getattr(self, f"rpc_{method}", None) if isinstance(method, str) else None
        if fn is None:
            raise UnknownMethod(f"unknown method {method!r}")
        return fn

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        """One client connection. Whatever goes wrong here ends this connection only."""
        try:
            await self._serve_connection(stream)
        except Exception as e:  # noqa: BLE001 (groups included; cancellation still propagates)
            if not _disconnect(e):
                log.warning("connection closed after an error", exc_info=e)
        finally:
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        decoder = frame.FrameDecoder(self.max_frame)
        slots = trio.Semaphore(MAX_INFLIGHT)
        live = True

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
                out = _result_frame(rid, result)
            except Exception as e:
                out = _error_frame(rid, e)
            if not writer.now(out):
                nursery.start_soon(writer.send, out)  # after the frame being written

        async def finish(rid: int, coro) -> None:
            try:
                try:
                    out = _result_frame(rid, await coro)
                except (KeraError, Exception) as e:
                    out = _error_frame(rid, e)
                await writer.send(out)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                slots.release()

        try:
            async with trio.open_nursery() as nursery:
                writer = FrameWriter(stream.socket, nursery, lambda why: None)
                try:
                    while True:
                        data = await stream.receive_some(RECV_SIZE)
                        if not data:
                            if decoder.pending:  # a client whose send was cut: never a request
                                log.info("connection closed inside a frame (%d bytes dropped)",
                                         decoder.pending)
                            break
                        decoder.feed(data)
                        while (f := decoder.next()) is not None:
                            if f.kind != frame.REQUEST:
                                raise ProtocolError("expected a request frame")
                            try:  # no scheduling point while requests are queued: appends batch up
                                slots.acquire_nowait()
                            except trio.WouldBlock:
                                await slots.acquire()
                            try:
                                res = self.lookup(f.meta.get("m"))(f.meta, f.payload)
                                if inspect.iscoroutine(res):
                                    nursery.start_soon(finish, f.request_id, res)
                                    continue
                                if type(res) is Later:
                                    res._bind(partial(answer, f.request_id))
                                    continue
                                out = _result_frame(f.request_id, res)  # a reply too large: its error
                            except Exception as e:
                                out = _error_frame(f.request_id, e)
                            slots.release()
                            await writer.send(out)
                except ProtocolError as e:
                    # garbage: say why (best effort), then drop this connection only
                    with trio.move_on_after(1):
                        await writer.send(_error_frame(0, e))
                finally:
                    live = False
                    nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.serve_connection, listeners)


class _Posted:
    """A posted request's place in ``pending``: the reader's ``set`` hands its answer on."""

    __slots__ = ("conn", "slot", "done")

    def __init__(self, conn: Connection, done):
        self.conn, self.done = conn, done
        self.slot = [self, None, trio.current_time()]   # (whom to tell, the answer, when sent)

    def set(self) -> None:
        try:
            self.done(self.conn._answer(self.slot[1]))
        except Exception as e:  # noqa: BLE001 (the answer was bad, not the pool: this connection goes)
            log.warning("answer to a posted request on %s failed", self.conn.addr, exc_info=e)
            self.conn._tear(f"bad answer to a posted request: {e}")


class Connection:
    """One pipelined connection; ``call`` may be used by many tasks at once, ``post`` from
    anywhere on the loop."""

    def __init__(self, addr: str, stream: trio.SocketStream, max_frame: int, nursery: trio.Nursery):
        self.addr = addr
        self.stream = stream
        self.decoder = frame.FrameDecoder(max_frame)
        self.pending: dict[int, list] = {}
        self.next_id = 1
        # a posted frame's rest is finished by a task of the pool's nursery
        self.writer = FrameWriter(stream.socket, nursery, self._tear)
        self.closed = False
        self.error: Exception | None = None
        self.heard = trio.current_time()   # when bytes last arrived

    async def reader(self) -> None:
        try:
            while True:
                data = await self.stream.receive_some(RECV_SIZE)
                if not data:
                    raise Unavailable(f"{self.addr} closed the connection")
                self.heard = trio.current_time()
                self.decoder.feed(data)
                while (f := self.decoder.next()) is not None:
                    slot = self.pending.pop(f.request_id, None)
                    if slot is None:
                        if f.kind == frame.ERROR and f.request_id == 0:
                            raise from_wire(f.meta)  # about the connection itself: it is closing
                        continue  # its caller gave up (timeout, cancel): drop it, keep the connection
                    slot[1] = f
                    slot[0].set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, KeraError) as e:
            self._fail(e if isinstance(e, KeraError) else Unavailable(f"{self.addr}: {e}"))
        finally:
            self._fail(Unavailable(f"connection to {self.addr} closed"))
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def _fail(self, err: Exception) -> None:
        if not self.closed:
            self.closed = True
            self.error = err
        for ev, *_ in list(self.pending.values()):
            ev.set()
        self.pending.clear()

    def _request(self, method: str, meta, payload, parts) -> tuple[int, bytes | list]:
        rid = self.next_id
        self.next_id = (rid + 1) & 0xFFFFFFFF or 1
        m = dict(meta or ())
        m["m"] = method
        return rid, (_parts_frame(frame.REQUEST, rid, m, parts) if parts is not None
                     else frame.encode(frame.REQUEST, rid, m, payload))

    def _answer(self, f: frame.Frame | None):
        """A response's (meta, payload), or the error it is (none: the connection's)."""
        if f is None:
            return Unavailable(str(self.error))
        if f.kind == frame.ERROR:
            err = from_wire(f.meta)
            err._peer = self.addr   # an answer, not a transport failure
            return err
        return f.meta, f.payload

    def post(self, method: str, meta: dict, done, *, parts) -> int | None:
        """Send a request without waiting, if it can start at once (nobody else is sending):
        its answer, (meta, payload) or a ``KeraError`` (the connection's failure included),
        goes to ``done`` from the reader. A frame the socket does not take whole is finished
        by a task. Returns the request's id (``forget`` it on a timeout), or None: nothing
        was sent."""
        if self.closed or self.writer.busy:
            return None
        rid, data = self._request(method, meta, b"", parts)
        self.writer.now(data, rid)   # not busy (checked above): written, begun, or failed
        if self.closed:
            return None   # the send failed: the connection is torn
        self.pending[rid] = _Posted(self, done).slot
        return rid

    def forget(self, rid: int, timed_out: bool = False) -> None:
        """A posted request given up on: its answer is dropped when it comes; if its frame is
        still being written, or it ``timed_out`` with nothing heard on the connection since it
        was sent (``_silent``), the connection is closed."""
        slot = self.pending.pop(rid, None)
        if self.writer.finishing == rid:
            self._tear("a request was given up on while being sent")
        elif timed_out and slot is not None:
            self._silent(slot[2])

    def _silent(self, since: float) -> None:
        """A request sent at ``since`` timed out: if nothing arrived since, the peer is gone or
        cut off, and the connection is closed, unless a request sent later still waits (it
        closes the connection when its own time is up, if still nothing came)."""
        if self.heard < since and not any(w[2] > since for w in self.pending.values()):
            self._tear(f"nothing heard for {trio.current_time() - since:.1f} s")

    async def call(self, method: str, meta: dict | None = None, payload=b"", *,
                   timeout: float | None = None, parts=None):
        """Send a request and wait for its response: returns (meta, payload)."""
        if self.closed:
            raise unsent(Unavailable(str(self.error)))
        rid, data = self._request(method, meta, payload, parts)
        sent = trio.current_time()
        slot = [trio.Event(), None, sent]   # (whom to tell, the answer, when sent)
        self.pending[rid] = slot
        sending = False
        try:
            with trio.fail_after(timeout if timeout is not None else math.inf):
                await _take(self.writer.lock)
                try:
                    if self.closed:
                        raise unsent(Unavailable(str(self.error)))
                    try:
                        sending = True
                        await send_frame(self.stream, data)
                    except BaseException as e:
                        # part of the frame may be on the wire: nothing more may follow it
                        self._tear(f"send of {method} interrupted ({type(e).__name__})")
                        raise
                finally:
                    self.writer.lock.release()
                await slot[0].wait()
        except trio.TooSlowError:
            self.pending.pop(rid, None)
            if not sending:   # still waiting for its turn to send
                raise unsent(Unavailable(f"{method} to {self.addr} not sent within {timeout:.3g} s")) from None
            self._silent(sent)
            raise Unavailable(f"{method} to {self.addr} timed out after {timeout:.3g} s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self.pending.pop(rid, None)
            self._fail(Unavailable(f"{self.addr}: {e}"))
            raise Unavailable(f"{self.addr}: {e}") from None
        except BaseException:
            self.pending.pop(rid, None)
            raise
        r = self._answer(slot[1])
        if isinstance(r, KeraError):
            raise r
        return r

    def _tear(self, why: str) -> None:
        """Close at once (no checkpoint: the caller may be cancelled): the peer sees the
        end of the stream after a partial frame and never reads it as a request."""
        self._fail(Unavailable(f"connection to {self.addr} closed: {why}"))
        self.stream.socket.close()  # wakes the reader, which ends

    async def aclose(self) -> None:
        self._fail(Unavailable(f"connection to {self.addr} closed"))
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class Pool:
    """Connections by address, their reader tasks owned by this pool's nursery."""

    def __init__(self, nursery: trio.Nursery, max_frame: int = MAX_FRAME,
                 connect_timeout: float = 5.0):
        self.nursery = nursery
        self.max_frame = max_frame
        self.connect_timeout = connect_timeout
        self.conns: dict[str, Connection] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def get(self, addr: str, timeout: float | None = None) -> Connection:
        """The open connection to ``addr``, or a new one (within ``connect_timeout``, or
        ``timeout`` if shorter)."""
        c = self.conns.get(addr)
        if c is not None and not c.closed:
            return c
        lock = self._locks.setdefault(addr, trio.Lock())
        async with lock:
            c = self.conns.get(addr)
            if c is not None and not c.closed:
                return c
            host, port = parse_addr(addr)
            try:
                with trio.fail_after(min(self.connect_timeout, math.inf if timeout is None else timeout)):
                    stream = await trio.open_tcp_stream(host, port)
            except (OSError, trio.TooSlowError) as e:
                raise unsent(Unavailable(f"cannot connect to {addr}: {str(e) or 'timed out'}")) from None
            stream.setsockopt(6, 1, 1)  # TCP_NODELAY
            c = Connection(addr, stream, self.max_frame, self.nursery)
            self.conns[addr] = c
            self.nursery.start_soon(c.reader)
            return c

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
