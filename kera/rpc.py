"""Thin trio transport around the sans-IO frame codec: frames out (``FrameWriter``),
answers given later (``Later``), and the client side (``Pool``, ``Connection``). The
serving side is ``kera.server``.

Clients: ``Pool`` owns one pipelined connection per address and the reader
tasks that match responses to requests by id. A new connection first presents the
pool's credentials (``kera.security.credentials``: a member's proof, a user's login,
or nothing), once, before any request. A send that was cancelled or
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

import logging
import math
import os
from contextlib import asynccontextmanager

import trio

from . import frame, iov
from .errors import KeraError, PeerTooSlow, Unavailable, from_wire
from .limits import MAX_FRAME
from .security.credentials import ANONYMOUS, Credentials

log = logging.getLogger("kera.rpc")

MAX_INFLIGHT = 256
RECV_SIZE = 1 << 20
VECTOR_FROM = 1 << 16  # a frame of parts this large goes out vectored (sendmsg), not joined first,
VECTOR_PART = 1 << 12  # when its parts average this much: many tiny parts cost less joined
TLS_PIECE = 1 << 18    # bytes a TLS stream is handed per send_all (a frame's buffers joined up to it)


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


def _size(data: bytes | list) -> int:
    return len(data) if type(data) is bytes else sum(map(frame.nbytes, data))


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


async def _send_rest(sock, vs: list[memoryview], i: int, timeout: float = math.inf) -> None:
    """Write what is left, waiting for the socket; ``PeerTooSlow`` if it takes no byte for
    ``timeout`` seconds (a peer that does not read)."""
    while (i := _write(sock, vs, i)) < len(vs):
        with trio.move_on_after(timeout) as cs:
            await trio.lowlevel.wait_writable(sock)
        if cs.cancelled_caught:
            raise PeerTooSlow(f"the peer took no byte for {timeout} s")


async def send_frame(stream: trio.SocketStream, data: bytes | list) -> None:
    """Send one frame (bytes, or a list of buffers sent vectored: no copy into one buffer),
    written straight to the socket: a frame the kernel takes at once costs one system call
    and no trip through the scheduler; past a full socket buffer it waits until the socket
    is writable. Callers hold the connection's send lock (``_take``)."""
    await _send_rest(stream.socket, _views(data), 0)


def _pieces(vs: list[memoryview], i: int):
    """``vs[i:]`` in pieces of about ``TLS_PIECE`` bytes for a TLS stream: each ``send_all``
    encrypts into records and sends them in one go, so a frame of many small buffers (a
    produce's or a replicate's chunks) costs a few calls, not one (and a record) per buffer."""
    run, size = [], 0
    for v in vs[i:]:
        if size and size + len(v) > TLS_PIECE:
            yield run[0] if len(run) == 1 else b"".join(run)
            run, size = [], 0
        run.append(v)
        size += len(v)
    if run:
        yield run[0] if len(run) == 1 else b"".join(run)


async def _take(lock: trio.Semaphore) -> None:
    """Take ``lock``: at once when it is free (no trip through the scheduler), else in turn."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class FrameWriter:
    """A connection's sending side: frames go out one at a time under one send lock (a
    Semaphore, not a Lock: a write begun by one task may be finished by another). On a
    plain socket they are written straight to it (``os.writev``): ``now`` writes a frame
    from anywhere on the loop (an answer settled by whoever, a posted request) without a
    task when nobody else is sending and the socket takes it; a frame it begins but the
    socket does not take whole is finished by a task of ``nursery``. On a TLS stream every
    frame goes through the stream (``send_all``), by a task when ``now`` is asked.
    ``broken(why)`` is told when a write fails. ``timeout``: a peer that takes no byte for
    that long is cut off; ``budget``: bytes of frames that may wait for the lock (or a task)
    before the connection is cut off as not reading."""

    __slots__ = ("stream", "sock", "lock", "nursery", "broken", "finishing", "timeout", "budget",
                 "queued")

    def __init__(self, stream, nursery: trio.Nursery, broken, timeout: float = math.inf,
                 budget: float = math.inf):
        self.stream = stream
        self.sock = getattr(stream, "socket", None)   # None: a TLS stream
        self.lock = trio.Semaphore(1)
        self.nursery = nursery
        self.broken = broken
        self.finishing = None   # the tag ``now`` was given for the frame a task is finishing
        self.timeout, self.budget = timeout, budget
        self.queued = 0         # bytes of frames waiting to be sent by a task

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
        if self.sock is None:
            self.finishing = tag
            self.nursery.start_soon(self._rest, vs, 0)
            return True
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

    async def _out(self, vs: list, i: int) -> None:
        if self.sock is not None:
            await _send_rest(self.sock, vs, i, self.timeout)
            return
        with trio.move_on_after(self.timeout) as cs:
            for piece in _pieces(vs, i):
                await self.stream.send_all(piece)
        if cs.cancelled_caught:
            raise PeerTooSlow(f"the peer took no reply for {self.timeout} s")

    async def _rest(self, vs: list, i: int) -> None:
        try:
            await self._out(vs, i)
        except PeerTooSlow:
            self.broken("send_cut")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self.broken(f"send failed: {e}")
        except BaseException as e:
            self.broken(f"send interrupted ({type(e).__name__})")
            raise
        finally:
            self.finishing = None
            self.lock.release()

    def _count(self, n: int) -> None:
        self.queued += n
        if self.queued > self.budget:
            self.broken("budget_cut")
            raise trio.BrokenResourceError("replies queued past the connection's budget")

    async def send(self, data: bytes | list) -> None:
        """Send one frame, in turn."""
        n = _size(data) if self.budget != math.inf else 0
        self._count(n)
        try:
            await _take(self.lock)
            try:
                await self._out(_views(data), 0)
            except PeerTooSlow:
                self.broken("send_cut")
                raise trio.BrokenResourceError("the peer does not read") from None
            finally:
                self.lock.release()
        finally:
            self.queued -= n

    def queue(self, data: bytes | list) -> None:
        """Send one frame in turn, by a task: its bytes count against the budget meanwhile."""
        self.nursery.start_soon(self._queued, data)

    async def _queued(self, data) -> None:
        try:
            await self.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


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


def result_frame(rid: int, result) -> bytes | list:
    if result is None:
        result = {}
    if isinstance(result, tuple):
        meta, payload = result
        if isinstance(payload, list):
            return _parts_frame(frame.RESPONSE, rid, meta, payload)
        return frame.encode(frame.RESPONSE, rid, meta, payload)
    return frame.encode(frame.RESPONSE, rid, result)


def error_frame(rid: int, err: Exception) -> bytes:
    if isinstance(err, KeraError):
        info = err.to_wire()
    else:
        log.exception("internal error", exc_info=err)
        info = {"code": "internal", "message": f"{type(err).__name__}: {err}"}
    return frame.encode(frame.ERROR, rid, info)


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
        self.writer = FrameWriter(stream, nursery, self._tear)
        self.generation = 0     # of the pool's credentials it presented
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
                        await self.writer._out(_views(data), 0)
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
        raw_socket(self.stream).close()  # wakes the reader, which ends

    async def aclose(self) -> None:
        self._fail(Unavailable(f"connection to {self.addr} closed"))
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


def raw_socket(stream):
    """The socket under a stream, TLS or not."""
    return stream.socket if hasattr(stream, "socket") else stream.transport_stream.socket


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
        try:
            with trio.fail_after(limit):
                stream = await trio.open_tcp_stream(host, port)
                stream.setsockopt(6, 1, 1)  # TCP_NODELAY
                if creds.tls is not None:
                    stream = trio.SSLStream(stream, creds.tls, server_hostname=host,
                                            https_compatible=True)
                    await stream.do_handshake()
        except (OSError, trio.TooSlowError, trio.BrokenResourceError) as e:
            raise unsent(Unavailable(f"cannot connect to {addr}: {_why(e)}")) from None
        c = Connection(addr, stream, self.max_frame, self.nursery)
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
