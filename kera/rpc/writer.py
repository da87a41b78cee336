"""A connection's sending side: frames out one at a time, in turn, written straight to the
socket (``kera.rpc.channel``), with the deadline and byte budget of a server's door."""

from __future__ import annotations

import math

import trio

from .. import frame, iov
from ..errors import PeerTooSlow
from ..limits import VECTOR_FROM, VECTOR_PART
from .channel import Outgoing, send_rest


def parts_frame(kind: int, rid: int, meta: dict, parts) -> bytes | list:
    """A frame whose payload is ``parts``: joined when small or of tiny parts, else its buffers
    as they are (written vectored: no copy into one buffer)."""
    plen = sum(map(frame.nbytes, parts))   # counted once: a replication frame has a part per chunk
    bufs = frame.frame_buffers(kind, rid, meta, parts, plen)
    total = len(bufs[0]) + plen
    return bufs if total >= VECTOR_FROM and total >= len(bufs) * VECTOR_PART else b"".join(bufs)


def views(data: bytes | list) -> list[memoryview]:
    return iov.views(data) if isinstance(data, list) else [memoryview(data)]


def size(data: bytes | list) -> int:
    return len(data) if type(data) is bytes else sum(map(frame.nbytes, data))


async def send_frame(stream: trio.SocketStream, data: bytes | list) -> None:
    """Send one frame in the clear (bytes, or a list of buffers sent vectored): a frame the
    kernel takes at once costs one system call and no trip through the scheduler."""
    await send_rest(stream.socket, Outgoing(views(data)))


async def take(lock: trio.Semaphore) -> None:
    """Take ``lock``: at once when it is free (no trip through the scheduler), else in turn."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class FrameWriter:
    """Frames go out one at a time under one send lock (a Semaphore, not a Lock: a write
    begun by one task may be finished by another), through ``channel`` (plain or TLS: the
    same path). ``now`` writes a frame from anywhere on the loop (an answer settled by
    whoever, a posted request) without a task when nobody else is sending and the socket
    takes it; a frame it begins but the socket does not take whole is finished by a task of
    ``nursery``. ``broken(why)`` is told when a write fails. ``timeout``: a peer that takes
    no byte for that long is cut off; ``budget``: bytes of frames that may wait for the lock
    (or a task) before the connection is cut off as not reading."""

    __slots__ = ("channel", "sock", "lock", "nursery", "broken", "finishing", "timeout", "budget",
                 "queued")

    def __init__(self, channel, nursery: trio.Nursery, broken, timeout: float = math.inf,
                 budget: float = math.inf):
        self.channel, self.sock = channel, channel.socket
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
        out = self.channel.outgoing(views(data))
        try:
            done = out.push(self.sock)
        except trio.BrokenResourceError as e:
            self.lock.release()
            self.broken(f"send failed: {e}")
            return True
        if done:
            self.lock.release()
        else:
            self.finishing = tag
            self.nursery.start_soon(self._rest, out)
        return True

    async def out(self, data: bytes | list) -> None:
        """Write one frame whole; the caller holds the lock. ``PeerTooSlow`` past the timeout."""
        await send_rest(self.sock, self.channel.outgoing(views(data)), self.timeout)

    async def _rest(self, out: Outgoing) -> None:
        try:
            await send_rest(self.sock, out, self.timeout)
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
        n = size(data) if self.budget != math.inf else 0
        self._count(n)
        try:
            await take(self.lock)
            try:
                await self.out(data)
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
