"""A connection's bytes, in the clear (``Plain``) or through TLS (``Tls``), and a frame on its
way to the socket (``Outgoing``, ``Sealed``).

Both kinds move bytes on the socket themselves. A frame the kernel takes at once is written
with one system call from wherever it was made (an answer settled by a replication outcome,
a posted request): no task, no trip through the scheduler; the rest waits for the socket.

TLS drives an ``ssl.SSLObject`` over memory BIOs on that same path instead of trio's
``SSLStream``, which returns one 16 KB TLS record per receive, goes through the scheduler on
every socket call, and needs a task for every frame it sends: at 512 streams, R=3, that cost
more than the ciphers themselves. Here a receive decrypts every whole record that arrived
(up to ``RECV_SIZE`` at once), and a frame is encrypted ``TLS_PIECE`` bytes at a time, the
next piece once the socket took the last one's ciphertext, so a connection holds at most
one piece unsent. The receive buffers are one pair per thread, reused by every connection:
nothing waits between filling and emptying them.
"""

from __future__ import annotations

import math
import os
import ssl
import threading

import trio

from .. import iov
from ..errors import PeerTooSlow
from ..limits import RECV_SIZE, TLS_PIECE, TLS_RECORD

_EOF = (ssl.SSLZeroReturnError, ssl.SSLEOFError)   # the peer's end, said or not (as HTTPS takes it)


def write_some(sock, vs: list[memoryview], i: int) -> int:
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


class Outgoing:
    """A frame's buffers on their way to the socket, as they are."""

    __slots__ = ("vs", "i")

    def __init__(self, vs: list[memoryview]):
        self.vs, self.i = vs, 0

    def push(self, sock) -> bool:
        """Write what the socket takes now; True once every byte is written."""
        self.i = write_some(sock, self.vs, self.i)
        return self.i == len(self.vs)


def pieces(vs: list[memoryview]):
    """``vs`` in pieces of at most ``TLS_PIECE`` bytes: small buffers (a produce's or a
    replicate's chunks) joined, so that they make a few full TLS records, not one each; a
    buffer of a record or more as it is (its records are full without a copy)."""
    run, size = [], 0
    for v in vs:
        if len(v) >= TLS_RECORD or size + len(v) > TLS_PIECE:
            if run:
                yield run[0] if len(run) == 1 else b"".join(run)
                run, size = [], 0
            if len(v) >= TLS_RECORD:
                for at in range(0, len(v), TLS_PIECE):
                    yield v[at:at + TLS_PIECE]
                continue
        run.append(v)
        size += len(v)
    if run:
        yield run[0] if len(run) == 1 else b"".join(run)


class Sealed(Outgoing):
    """A frame over TLS: encrypted ``TLS_PIECE`` bytes of plaintext at a time into one
    ciphertext buffer (``Tls.sealing``), each once the last one's ciphertext is written (a
    frame of one buffer no larger than a piece, most of them, at once). Made under the
    connection's send lock: ciphertext leaves in the order it was made."""

    __slots__ = ("left", "tls")

    def __init__(self, vs: list[memoryview], tls: Tls):
        if len(vs) == 1 and len(vs[0]) <= TLS_PIECE:
            super().__init__([memoryview(tls.seal(vs[0]))])
            self.left = None
        else:
            super().__init__([])
            self.left = tls.sealing(vs)
        self.tls = tls

    def push(self, sock) -> bool:
        while Outgoing.push(self, sock):
            piece = None if self.left is None else next(self.left, None)
            if piece is None:
                self.tls.sending = False
                return True
            self.vs, self.i = [memoryview(piece)], 0
        self.tls.sending = True   # ciphertext not on the wire yet: no close_notify now
        return False


async def send_rest(sock, out: Outgoing, timeout: float = math.inf) -> None:
    """Write ``out`` whole, waiting for the socket; ``PeerTooSlow`` if it takes no byte for
    ``timeout`` seconds (a peer that does not read)."""
    while not out.push(sock):
        with trio.move_on_after(timeout) as cs:
            await trio.lowlevel.wait_writable(sock)
        if cs.cancelled_caught:
            raise PeerTooSlow(f"the peer took no byte for {timeout} s")


class Plain:
    """A connection in the clear over ``stream`` (a trio ``SocketStream``, or what has its
    ``receive_some``, ``aclose`` and ``socket``)."""

    __slots__ = ("stream", "socket")

    def __init__(self, stream):
        self.stream, self.socket = stream, stream.socket

    async def receive(self) -> bytes:
        """What arrived (b"": the peer closed)."""
        return await self.stream.receive_some(RECV_SIZE)

    def outgoing(self, vs: list[memoryview]) -> Outgoing:
        return Outgoing(vs)

    def getpeercert(self) -> dict | None:
        return None

    def close(self) -> None:
        """At once, with no checkpoint (the caller may be cancelled): whoever waits on the
        socket wakes, and the peer sees the end of the stream."""
        self.socket.close()

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Buffers(threading.local):
    """One thread's receive buffers: ciphertext from the socket, plaintext out of TLS."""

    def __init__(self):
        self.raw = memoryview(bytearray(RECV_SIZE))
        self.plain = memoryview(bytearray(RECV_SIZE + TLS_RECORD))


_buffers = _Buffers()


class Tls(Plain):
    """A connection through TLS over ``stream``'s socket; ``handshake`` before anything else."""

    __slots__ = ("obj", "incoming", "out", "sending", "ended")

    def __init__(self, stream, ctx: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None):
        super().__init__(stream)
        self.incoming, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.out, server_side=server_side,
                                server_hostname=server_hostname)
        self.sending = False   # a frame's ciphertext is partly written
        self.ended = False     # the peer's close_notify (or end of stream) was read

    async def handshake(self) -> None:
        """TLS's handshake; ``BrokenResourceError`` (its cause the ``ssl`` error) if it fails."""
        while True:
            try:
                self.obj.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            except (ssl.SSLError, ssl.CertificateError) as e:
                await self._flush()   # the alert tells the peer why
                raise trio.BrokenResourceError from e
            await self._flush()
            if done:
                return
            if not await self._fill():
                raise trio.BrokenResourceError("the peer closed the connection in the TLS handshake")

    async def _flush(self) -> None:
        data = self.out.read()
        if data:
            await send_rest(self.socket, Outgoing([memoryview(data)]))

    async def _fill(self) -> bool:
        """Bytes from the socket into the TLS object, waiting for some; False at its end."""
        raw = _buffers.raw
        while True:
            try:
                n = os.readv(self.socket.fileno(), [raw])   # closed: fileno -1, EBADF
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.socket)
        if not n:
            self.incoming.write_eof()
            return False
        self.incoming.write(raw[:n])
        return True

    def _open(self) -> bytes | None:
        """The plaintext of every whole record received (b"": the peer closed), or None.
        ``obj`` is read only while ``incoming`` holds a byte (or its end) or ``obj`` holds
        plaintext: with nothing left, a read raises ``SSLWantReadError``, which costs as much
        as opening a small record, and a receive made one or two of them."""
        buf, n, bio = _buffers.plain, 0, self.incoming
        try:   # a read with no byte left in bio nor plaintext in obj would raise WantRead (2 us)
            while n <= RECV_SIZE and (bio.pending or bio.eof or self.obj.pending()):
                got = self.obj.read(TLS_RECORD, buf[n:])
                if not got:   # the peer's close_notify
                    self.ended = True
                    break
                n += got
        except ssl.SSLWantReadError:
            pass
        except _EOF:
            self.ended = True   # the records before the end first; then reads say b""
        except ssl.SSLError as e:
            raise trio.BrokenResourceError from e
        if n:   # copied out before the checkpoint: another connection's receive reuses buf
            return bytes(buf[:n])
        return b"" if self.ended else None

    async def receive(self) -> bytes:
        """What arrived, decrypted: every whole record the socket held (b"": the peer closed).
        A checkpoint, as a socket's receive is."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while (data := self._open()) is None:
            try:
                n = os.readv(self.socket.fileno(), [_buffers.raw])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.socket)
                waited = True
                continue
            if n:
                self.incoming.write(_buffers.raw[:n])
            else:
                self.incoming.write_eof()
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    def seal(self, piece) -> bytes:
        """``piece`` encrypted into records, after anything TLS itself had to send."""
        self._write(piece)
        return self.out.read()

    def _write(self, piece) -> None:
        try:
            self.obj.write(piece)
        except ssl.SSLError as e:
            raise trio.BrokenResourceError from e

    def sealing(self, vs: list[memoryview]):
        """``vs`` encrypted: the ciphertext of its ``pieces``, gathered until it holds
        ``TLS_PIECE`` bytes of plaintext (one buffer and one system call for them all).
        Each piece was a buffer and a system call of its own: a replicate of 16 KB chunks
        made one per chunk."""
        held = 0
        for piece in pieces(vs):
            self._write(piece)
            held += len(piece)
            if held >= TLS_PIECE:
                yield self.out.read()
                held = 0
        if held:
            yield self.out.read()

    def outgoing(self, vs: list[memoryview]) -> Sealed:
        return Sealed(vs, self)

    def getpeercert(self) -> dict | None:
        return self.obj.getpeercert()

    async def aclose(self) -> None:
        """close_notify if no frame is half written (best effort, never waiting), then close."""
        if not self.sending and self.socket.fileno() != -1:
            try:
                self.obj.unwrap()
            except ssl.SSLError:
                pass   # it waits for the peer's close_notify: not us
            try:
                os.write(self.socket.fileno(), self.out.read())
            except OSError:
                pass
        await self.stream.aclose()
