"""Pull sessions: a reader of many streamlets names them once, then asks for what is new.

A plain pull names every streamlet it reads with its position, and the broker
looks at each: a consumer of a million streams would send and walk a million
entries per poll. A session (Kafka's incremental fetch sessions, KIP-227) keeps
the reader's streamlets and positions on the broker: each pull carries only the
positions that changed (``add``: the reader moved them, or names them for the
first time) and the streamlets it leaves (``drop``), and the broker reads only
the *ready* ones: those just added or moved, those whose last read found data
(there may be more), and those whose newest chunks became durable since
(``touch``, called by the produce path once they are). A streamlet whose read
finds nothing leaves the ready set until it is touched again. So a pull costs
what moved, not what the session holds, and an idle session costs nothing.

A reader that says so (``epoch``) lets the broker move its positions as it
answers: the positions after each streamlet's chunks are kept *tentatively*
with the answer's epoch, and made the session's when the next pull names that
epoch (the reader got the answer); a pull naming an older one (the answer was
lost) drops them, and those streamlets are read again from where they were. So
a lost answer is still read again, never skipped, and a reader no longer tells
the broker every position its chunks moved (a reader of 100,000 streams of one
chunk each named them all a second time). A reader that names no epoch moves
them itself (``add``), as before. A streamlet whose read found data is read
again only when it stopped at the pull's byte budget; newer data arrives by
``touch``.

A streamlet that fails (not owned here, recovering, out of range) is reported
and leaves the session; the reader adds it again where and when it can.
Sessions are soft state: a broker keeps at most ``MAX_PULL_SESSIONS`` (the
least recently used goes) and forgets them when it restarts; a pull naming one
it does not hold gets ``UnknownSession`` and the reader opens a new one.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import trio

from .. import limits
from ..errors import UnknownSession

Key = tuple[int, int]   # (stream id, streamlet)


class PullSession:
    __slots__ = ("id", "owner", "readers", "positions", "ready", "queued", "event", "epoch", "moved")

    def __init__(self, sid: int, owner: str, readers: dict | None = None):
        self.id, self.owner = sid, owner   # the principal that opened it
        self.readers = {} if readers is None else readers   # its broker's: key -> sessions
        self.positions: dict[Key, tuple[int, dict]] = {}   # the reader's (low, {group: position})
        self.ready: deque[Key] = deque()   # to read, oldest first
        self.queued: set[Key] = set()      # what ``ready`` holds
        self.event = trio.Event()          # set when a streamlet becomes ready
        self.epoch = 0                     # of the last answer
        self.moved: dict[Key, tuple[int, dict]] = {}   # positions after it, until acknowledged

    def set(self, key: Key, low: int, groups: dict) -> None:
        if key not in self.positions:
            r = self.readers.get(key)
            if r is None:
                self.readers[key] = {self}
            else:
                r.add(self)
        self.positions[key] = (low, groups)
        if self.moved:
            self.moved.pop(key, None)
        self.mark(key)

    def position(self, key: Key) -> tuple[int, dict]:
        """Where the reader is in ``key``: as the last answer left it, if it moved there."""
        return self.moved.get(key) or self.positions[key]

    def acknowledged(self, epoch: int | None) -> None:
        """A pull naming ``epoch`` (None: a reader moving its positions itself): the last
        answer's moves become the session's if the reader got it, else they are dropped and
        those streamlets read again."""
        moved, self.moved = self.moved, {}
        if epoch is not None and epoch == self.epoch:
            self.positions.update((k, v) for k, v in moved.items() if k in self.positions)
        else:
            for key in moved:
                if key in self.positions:
                    self.mark(key)

    def drop(self, key: Key) -> None:
        if self.positions.pop(key, None) is not None:
            readers = self.readers[key]
            readers.discard(self)
            if not readers:
                del self.readers[key]
        self.moved.pop(key, None)
        self.queued.discard(key)   # a stale entry of ``ready`` is skipped when reached

    def close(self) -> None:
        for key in list(self.positions):
            self.drop(key)

    def mark(self, key: Key) -> None:
        if key not in self.queued:
            self.queued.add(key)
            self.ready.append(key)
            self.event.set()

    def take(self) -> Key | None:
        """The next ready streamlet still in the session, out of the ready set."""
        while self.ready:
            key = self.ready.popleft()
            if key in self.queued:
                self.queued.discard(key)
                if key in self.positions:
                    return key
        return None


class PullSessions:
    """A broker's sessions, least recently used first."""

    def __init__(self):
        self.by_id: OrderedDict[int, PullSession] = OrderedDict()
        self.readers: dict[Key, set[PullSession]] = {}   # a streamlet -> the sessions reading it
        self._next = 1

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def open(self, owner: str) -> PullSession:
        if len(self.by_id) >= limits.MAX_PULL_SESSIONS:
            self.by_id.popitem(last=False)[1].close()
        s = self.by_id[self._next] = PullSession(self._next, owner, self.readers)
        self._next += 1
        return s

    def get(self, sid: int, owner: str) -> PullSession:
        s = self.by_id.get(sid)
        if s is None or s.owner != owner:
            raise UnknownSession(f"no pull session {sid} here (this broker restarted, or it "
                                 f"expired): open a new one")
        self.by_id.move_to_end(sid)
        return s

    def touch(self, keys) -> None:
        """Streamlets with newly durable chunks: ready in every session reading them (a lookup
        per streamlet in ``readers``, not a walk of every session)."""
        readers = self.readers
        for key in keys:
            for s in readers.get(key, ()):
                s.mark(key)
