"""One connection of a server: requests read in order, admitted by the wire table, run and
answered.

A handler ``rpc_<name>`` that is a plain function runs right there, in arrival order
(appends keep their order), and may return a coroutine for the part that waits, which runs
concurrently in the connection's nursery, or a ``Later`` that whoever settles it answers (a
produce's durability, settled by the replication's outcomes: no task per request). At most
``MAX_INFLIGHT`` requests per connection are in flight; past that the connection is not
read (backpressure). The door's deadlines (idle, frame, handshake) bound each wait for
bytes, its receive budget the large frames still arriving; the writer's, its replies.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from functools import partial

import trio

from .. import frame
from ..door import Deadline, Door
from ..errors import AuthenticationFailed, KeraError, PeerTooSlow, ProtocolError
from ..limits import MAX_INFLIGHT, SERVE_SLICE
from .answers import Later, error_frame, result_frame
from .writer import FrameWriter

log = logging.getLogger("kera.rpc")

CUT = {"idle_cut": "idle for longer than the idle timeout",
       "frame_cut": "a request did not arrive whole within the frame timeout",
       "handshake_cut": "did not authenticate within the handshake timeout",
       "send_cut": "did not take its replies within the send timeout",
       "budget_cut": "left more replies unread than its byte budget"}

_END = "end"   # a failed handshake: the connection ends


class Served:
    """``channel``: the connection's bytes; ``peer``: who it is (``kera.security.gate``);
    ``lookup(method)``: the table's entry and the handler, or ``UnknownMethod``."""

    def __init__(self, channel, peer, door: Door, lookup, max_frame: int):
        self.channel, self.peer, self.door, self.lookup = channel, peer, door, lookup
        self.decoder = frame.FrameDecoder(max_frame)
        self.slots = trio.Semaphore(MAX_INFLIGHT)
        self.live = True
        self.cut: str | None = None    # why the door cut the connection
        self.held = 0                  # bytes of a large frame counted in door.receiving
        self.deadline = Deadline(door.limits, trio.current_time())
        self.writer: FrameWriter | None = None
        self.nursery: trio.Nursery | None = None

    async def run(self) -> None:
        lim = self.door.limits
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                self.writer = FrameWriter(self.channel, nursery, self._broken, lim.send_timeout,
                                          lim.reply_budget)
                why = await self._read()
                if why in CUT:
                    self._cut(why)
                    self.writer.now(error_frame(0, PeerTooSlow(f"connection closed: {CUT[why]}")))
                self.live = False
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.live = False
            if self.held:
                self.door.hold(-self.held)

    def _cut(self, why: str) -> None:
        if self.cut is None:
            self.cut = why
            self.door.stats[why] += 1

    def _broken(self, why: str) -> None:
        """The writer failed (a send error, its deadline, its budget): the connection ends."""
        if why in CUT:
            self._cut(why)
        self.nursery.cancel_scope.cancel()

    async def _read(self) -> str | None:
        """Requests until the peer closes or sends garbage (None), a handshake fails
        (``_END``) or a deadline passes (its name)."""
        door, lim, deadline = self.door, self.door.limits, self.deadline
        with trio.CancelScope() as waiting:
            try:
                while True:
                    when, why = deadline.at(self.slots.value < MAX_INFLIGHT or self.writer.busy,
                                            self.peer.role is not None)
                    waiting.deadline = when
                    if self.held and door.receiving >= lim.receive_budget:
                        await door.room()
                    data = await self.channel.receive()
                    waiting.deadline = math.inf
                    if not data:
                        if self.decoder.pending:  # a client whose send was cut: never a request
                            log.info("connection closed inside a frame (%d bytes dropped)",
                                     self.decoder.pending)
                        return None
                    if not await self._received(data):
                        return _END
            except ProtocolError as e:
                # garbage: say why (best effort), then drop this connection only
                with trio.move_on_after(1):
                    await self.writer.send(error_frame(0, e))
                return None
        return why if waiting.cancelled_caught else None

    async def _received(self, data) -> bool:
        """Run the requests ``data`` completes; False: the connection ends."""
        decoder = self.decoder
        decoder.feed(data)
        now = self.deadline.active = trio.current_time()
        turn = time.monotonic() + SERVE_SLICE
        while (f := decoder.next()) is not None:
            if f.kind != frame.REQUEST:
                raise ProtocolError("expected a request frame")
            if time.monotonic() > turn:   # past its slice: the others' turn (heartbeats above all)
                await trio.lowlevel.checkpoint()
                turn = time.monotonic() + SERVE_SLICE
            try:  # else no scheduling point while requests are queued: appends batch up
                self.slots.acquire_nowait()
            except trio.WouldBlock:
                await self.slots.acquire()
            if not await self._request(f):
                return False
        self.deadline.frame_since = (self.deadline.frame_since or now) if decoder.pending else None
        if decoder.gathered != self.held:
            self.door.hold(decoder.gathered - self.held)
            self.held = decoder.gathered
        return True

    async def _request(self, f: frame.Frame) -> bool:
        """Admit and run one request (its slot taken); False: a failed handshake."""
        try:
            rpc, fn = self.lookup(f.meta.get("m"))
            try:
                rpc.admit(self.peer, f.meta)
            except KeraError:
                self.door.stats["requests_refused"] += 1
                raise
            res = fn(f.meta, f.payload, self.peer) if rpc.peer else fn(f.meta, f.payload)
            if inspect.iscoroutine(res):
                self.nursery.start_soon(self._finish, f.request_id, res)
                return True
            if type(res) is Later:
                res._bind(partial(self._answer, f.request_id))
                return True
            out = result_frame(f.request_id, res)  # a reply too large: its error
        except AuthenticationFailed as e:
            self.door.stats["auth_failed"] += 1
            self.slots.release()
            with trio.move_on_after(1):
                await self.writer.send(error_frame(f.request_id, e))
            return False
        except Exception as e:
            out = error_frame(f.request_id, e)
        self.slots.release()
        await self.writer.send(out)
        return True

    def _answer(self, rid: int, result) -> None:
        """A ``Later``'s answer, from whoever settled it: written at once if the socket is free
        and takes it, else by a task of this connection (a failed write: the reader sees the
        connection end)."""
        self.slots.release()
        if not self.live:
            return
        try:
            if isinstance(result, Exception):
                raise result
            out = result_frame(rid, result)
        except Exception as e:
            out = error_frame(rid, e)
        if not self.writer.now(out):
            self.writer.queue(out)   # after the frame being written

    async def _finish(self, rid: int, coro) -> None:
        try:
            try:
                out = result_frame(rid, await coro)
            except Exception as e:
                out = error_frame(rid, e)
            await self.writer.send(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.slots.release()
