"""One pipelined client connection: requests matched to their answers by id.

``call`` may be used by many tasks at once, ``post`` from anywhere on the loop (its answer
goes to a callback from the reader). A send that was cancelled or timed out may have left
part of a frame on the wire, so its connection is closed (the next call opens a new one); a
reply or error for a request no longer waited for is dropped and the connection stays,
unless nothing at all came back on it while that request waited and no request sent after
it still waits (that one decides when its own time is up): a peer silent for a whole
timeout is gone or cut off (a partition fails no connection), and its connection would
resume only at the kernel's next retransmission, seconds after the peer is back, so it is
closed and the next call connects afresh.
"""

from __future__ import annotations

import logging
import math

import trio

from .. import frame
from ..errors import KeraError, Unavailable, from_wire
from .writer import FrameWriter, parts_frame, take

log = logging.getLogger("kera.rpc")


def unsent(err: Unavailable) -> Unavailable:
    """``err``, marked as raised before any byte of its request left (a failed connect, a
    closed connection): the peer cannot have it, so it may be sent elsewhere or again."""
    err._unsent = True
    return err


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

    def __init__(self, addr: str, channel, max_frame: int, nursery: trio.Nursery):
        self.addr = addr
        self.channel = channel   # kera.rpc.channel: Plain or Tls
        self.decoder = frame.FrameDecoder(max_frame)
        self.pending: dict[int, list] = {}
        self.next_id = 1
        # a posted frame's rest is finished by a task of the pool's nursery
        self.writer = FrameWriter(channel, nursery, self._tear)
        self.generation = 0     # of the pool's credentials it presented
        self.closed = False
        self.error: Exception | None = None
        self.heard = trio.current_time()   # when bytes last arrived

    async def reader(self) -> None:
        try:
            while True:
                data = await self.channel.receive()
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
                await self.channel.aclose()

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
        return rid, (parts_frame(frame.REQUEST, rid, m, parts) if parts is not None
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
                await take(self.writer.lock)
                try:
                    if self.closed:
                        raise unsent(Unavailable(str(self.error)))
                    try:
                        sending = True
                        await self.writer.out(data)
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
        self.channel.close()  # wakes the reader, which ends

    async def aclose(self) -> None:
        self._fail(Unavailable(f"connection to {self.addr} closed"))
        with trio.CancelScope(shield=True):
            await self.channel.aclose()
