"""A Kafka connection's answers, written in the order its requests came.

Kafka answers a connection's requests in order. An answer is ready at once (most), settled
later by whoever makes it ready (a produce once its chunks are durable: a ``Later`` the
virtual logs' durability callbacks settle, no task waiting for it), or worked out by a task
(a Fetch's long poll, what asks the coordinator). ``Answers`` keeps them in order and writes
every answer ready at the head in one vectored write: straight from the receive loop once a
read's requests are handled, else by its sender task, woken once per wave of settlements
(so answers made durable together leave together). A settled-later answer not ready by its
deadline is given its timeout answer (a produce's ``REQUEST_TIMED_OUT``): the sender sleeps
until the head's deadline, so there is no timer per request. At most ``limit`` answers wait;
past that the connection is not read (``room``).
"""

from __future__ import annotations

import math
from collections import deque
from functools import partial

import trio

from ..errors import KeraError


class Drop(Exception):
    """A request Kafka drops the connection for."""


class Waiting:
    """A handler's answer settled later (``later``), or ``timed_out()`` after ``seconds``."""

    __slots__ = ("later", "seconds", "timed_out")

    def __init__(self, later, seconds: float, timed_out):
        self.later, self.seconds, self.timed_out = later, seconds, timed_out


class Answer:
    __slots__ = ("frame_of", "body", "ready", "deadline", "timed_out")

    def __init__(self, frame_of, body=None, ready: bool = False, deadline: float = math.inf,
                 timed_out=None):
        self.frame_of, self.body, self.ready = frame_of, body, ready
        self.deadline, self.timed_out = deadline, timed_out


class Answers:
    """``writer``: the connection's ``FrameWriter``; ``drop(why)``: end the connection."""

    def __init__(self, writer, drop, limit: int):
        self.queue: deque[Answer] = deque()
        self.writer = writer
        self.drop = drop
        self.limit = limit
        self.sending = False          # the sender task is writing: nobody else writes
        self.closing = False          # the peer closed: the sender ends once all is written
        self.wake = trio.Event()
        self.room = trio.Event()

    def close(self) -> None:
        self.closing = True
        self.wake.set()

    def full(self) -> bool:
        return len(self.queue) >= self.limit

    async def wait_room(self) -> None:
        while self.full():
            self.room = trio.Event()
            await self.room.wait()

    # -- answers, in request order ---------------------------------------------------------
    def ready(self, frame_of, body) -> None:
        self.queue.append(Answer(frame_of, body, True))

    def waiting(self, frame_of, w: Waiting) -> None:
        a = Answer(frame_of, deadline=trio.current_time() + w.seconds, timed_out=w.timed_out)
        self.queue.append(a)
        w.later._bind(partial(self._settled, a))

    def task(self, nursery, frame_of, coro) -> None:
        a = Answer(frame_of)
        self.queue.append(a)
        nursery.start_soon(self._run, a, coro)

    async def _run(self, a: Answer, coro) -> None:
        try:
            body = await coro
        except KeraError as e:
            body = e
        self._settled(a, body)

    def _settled(self, a: Answer, body) -> None:
        if a.ready:
            return   # timed out already
        a.body, a.ready = body, True
        if self.queue and self.queue[0] is a:
            self.wake.set()

    # -- writing ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the answers ready at the head now, if nobody is writing (else the sender
        task will)."""
        if not self.queue or not self.queue[0].ready:
            return
        if self.sending or self.writer.busy:
            self.wake.set()
            return
        parts = self._take()
        if parts:
            self.writer.now(parts)

    def _take(self) -> list:
        """The frames of the answers ready at the head, taken off the queue."""
        parts: list = []
        q = self.queue
        while q and q[0].ready:
            a = q.popleft()
            if isinstance(a.body, KeraError):
                self.drop(f"no answer: {a.body}")
                return []
            try:
                parts += a.frame_of(a.body)
            except Drop as e:
                self.drop(str(e))
                return []
        if len(q) < self.limit:
            self.room.set()
        return parts

    def _expire(self, now: float) -> None:
        q = self.queue
        for a in q:
            if a.ready:
                continue
            if a.deadline > now:
                break
            a.body, a.ready = a.timed_out(), True

    def _next_deadline(self) -> float:
        for a in self.queue:
            if not a.ready:
                return a.deadline
        return math.inf

    async def run(self) -> None:
        """The sender task: writes what became ready while the socket was busy or after a
        settlement, and times out answers past their deadline."""
        while not (self.closing and not self.queue):
            with trio.move_on_at(self._next_deadline()):
                await self.wake.wait()
            self.wake = trio.Event()
            self._expire(trio.current_time())
            self.sending = True
            try:
                while parts := self._take():
                    await self.writer.send(parts)
            finally:
                self.sending = False
