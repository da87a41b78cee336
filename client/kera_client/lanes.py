"""What a producer keeps per stream (``Route``) and per streamlet (``Lane``), and its buffer.

A producer writing to a million streams keeps one ``Route`` per stream it met
and one ``Lane`` per streamlet it wrote to: slotted objects holding everything
the hot paths touch (the stream's id and room, each streamlet's address, its
next sequence, its open chunk, its sealed chunks waiting to leave, whether it is
in a request), so a record or a chunk costs attribute reads, not lookups of
``(stream id, streamlet)`` tuples in a dict per concern.

``Buffer`` is what the producer's parts share under one lock: the bytes counted
against ``buffer.memory``, the records not settled yet, the settled counts, and
the events they wake each other with (``Waker``: the sender's next round).
"""

from __future__ import annotations

import threading
from collections import deque

import trio

from kera import chunk as chunkfmt
from kera.limits import MAX_CHUNK

_ROOM: dict[int, int] = {}   # segment size -> record bytes one chunk of the stream holds


def room_of(segment_size: int) -> int:
    r = _ROOM.get(segment_size)
    if r is None:
        r = _ROOM[segment_size] = chunkfmt.record_room(min(MAX_CHUNK, segment_size))
    return r


class Route:
    """A stream as the producer writes it. ``addrs``/``owners``: each streamlet's owner's
    address (None while none is alive) and incarnation, replaced when the coordinator says
    they moved; ``lanes``: a ``Lane`` per streamlet written to; ``sticky``: the open
    round-robin chunk, ``rr`` the streamlet round-robin is on (Kafka's sticky partitioner:
    it moves on when that chunk is sealed)."""

    __slots__ = ("name", "id", "streamlets", "segment_size", "room", "addrs", "owners", "lanes",
                 "sticky", "rr")

    def __init__(self, name: str, sid: int, streamlets: int, segment_size: int, addrs: tuple,
                 owners: tuple):
        self.name, self.id, self.streamlets, self.segment_size = name, sid, streamlets, segment_size
        self.room = room_of(segment_size)
        self.addrs, self.owners = addrs, owners
        self.lanes: list[Lane | None] = [None] * streamlets
        self.sticky = None
        self.rr = sid % streamlets

    def lane(self, i: int) -> Lane:
        lane = self.lanes[i]
        if lane is None:
            lane = self.lanes[i] = Lane(self, i)
        return lane

    def gone(self) -> None:
        """Deleted, or re-created under its name: nothing of it is served at these addresses."""
        self.addrs = (None,) * self.streamlets


class Lane:
    """One streamlet as the producer writes it: ``seq`` its next sequence, ``open`` its open
    chunk, ``queue`` its sealed chunks in sequence order, ``busy`` in a request (a streamlet
    is in at most one at a time), ``retry_at`` not sent before this (a refused chunk's
    backoff), ``gap`` the highest sequence given up on and not yet reset (the next chunk
    sent carries ``SEQ_RESET``), ``due`` its open chunk lingered out (sealed once the lane is free and the
    sender takes it);
    ``waits``: it is in the accumulator's ``waiting`` queue of address ``at`` (once)."""

    __slots__ = ("route", "index", "seq", "open", "queue", "busy", "retry_at", "gap", "due",
                 "waits", "at")

    def __init__(self, route: Route, index: int):
        self.route, self.index = route, index
        self.seq = 0
        self.open = None
        self.queue: list | None = None   # (a short list: its front is popped in order)
        self.busy = False
        self.retry_at = 0.0
        self.gap: int | None = None
        self.due = None
        self.waits = False
        self.at = None

    @property
    def addr(self) -> str | None:
        return self.route.addrs[self.index]

    @property
    def owner(self) -> tuple:
        return self.route.owners[self.index]


class Waker:
    """Wakes the sender's loop for its next round: at once from the loop's own thread, through
    trio's token from another (the synchronous producer's caller); once per round, not once
    per chunk."""

    def __init__(self):
        self.event = trio.Event()
        self.woken = False
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()

    def notify(self) -> None:
        if self.woken:
            return
        self.woken = True
        if threading.get_ident() == self._thread:
            self.event.set()
        else:
            self._token.run_sync_soon(self.set)

    def set(self) -> None:
        self.event.set()   # the event current when this runs, not when it was scheduled

    async def wait(self, timeout: float) -> None:
        """The next round: after ``timeout`` seconds, or once woken."""
        with trio.move_on_after(max(0.0, timeout)):
            await self.event.wait()
        self.event = trio.Event()
        self.woken = False


class Buffer:
    """The producer's books, shared by its parts under ``lock``: ``bytes`` counted against
    ``buffer.memory`` (``memory``), ``records`` not settled yet, ``acked`` and ``failed``;
    ``space`` is notified when some were settled (a blocked synchronous ``send``, ``poll``
    and ``flush`` wait on it), ``progress`` set for the loop's waiters."""

    def __init__(self, memory: int):
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)
        self.memory = memory
        self.bytes = 0
        self.records = 0
        self.acked = 0
        self.failed = 0
        self.progress = trio.Event()
        self.latencies: deque = deque(maxlen=100_000)  # seconds, a chunk's first record -> ack

    def full(self) -> bool:
        return self.bytes >= self.memory

    def wait_space(self) -> None:
        """Block the calling (non-loop) thread while the buffer is full (lock held)."""
        while self.bytes >= self.memory:
            self.space.wait(0.1)

    def settled(self) -> None:
        """Records were settled (or looked up): the loop's waiters look again."""
        self.progress.set()
        self.progress = trio.Event()
