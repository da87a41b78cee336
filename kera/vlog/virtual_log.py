"""VirtualLog: a replicated log of chunk references shared by many streamlets.

Pure decision logic, no I/O and no clock: the broker's replicator (trio) and
the simulator drive it alike. ``append`` records a reference (O(1));
``poll(now)`` says which replicate messages to send; ``on_reply`` and
``on_error`` take their outcomes; ``next_deadline`` says when a backoff or
an avoidance ends.

- Every virtual segment (vseg) with work is replicated at once (the open one
  and closed ones being re-replicated), each copy with at most ``window``
  messages in flight (``REPLICATE_INFLIGHT``), each carrying what was appended
  since the one before (group commit; the next round leaves before the last
  is answered). A copy's acknowledged length only grows by answers that say
  the backup holds a prefix of ours; a failure or an answer that does not fit
  forgets the copy's other messages and sends again from what it holds.
  One stuck vseg never holds back the copies of another.
- A failure (timeout, lost connection, a backup's error) is retried with
  exponential backoff. A copy that made no progress for ``timeout`` seconds,
  or failed ``MAX_FAILS`` times in a row, is given up: the vseg gets another
  backup (from offset 0) and avoids that one for ``timeout`` seconds, after
  which it is a candidate again. A backup that left the membership is
  replaced at once (a frozen vseg's copy is kept, see ``done``); one that
  restarted is asked from offset 0, the answers of its process before ignored.
- A backup that answers with its copy's length (a resend after a timeout,
  or a copy it kept from before) is taken at that length when it is a chunk
  boundary of ours: copies are prefixes of the same bytes.
- Durable head: a vseg's refs are *confirmed* once every copy acknowledged
  them; the vlog's durable head is the prefix of confirmed refs, and it
  passes into a vseg's successor only once every copy acknowledged the
  close, so a replay can tell a vseg's end from a lost tail. A group's
  durable part is a prefix. A closed, confirmed vseg that loses a
  copy stays confirmed (its bytes are on the broker and the other copies)
  and is re-replicated beside new writes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Container
from dataclasses import dataclass

from ..limits import REPLICATE_BATCH, REPLICATE_INFLIGHT
from .placement import BackupSet
from .virtual_segment import Copy, VirtualSegment


def vlog_id(epoch: int, index: int) -> int:
    """The id of a broker incarnation's ``index``-th vlog: the epoch in the high 32 bits, so
    an incarnation's vlogs (and the backups' copies of them) are told from its predecessors'."""
    return (epoch << 32) | index


def vlog_epoch(vlog: int) -> int:
    """The epoch of the incarnation that made vlog ``vlog``."""
    return vlog >> 32

MAX_FAILS = 5
BACKOFF_MIN = 0.02
BACKOFF_MAX = 1.0


@dataclass(frozen=True, slots=True)
class Send:
    """A replicate message: refs [start, stop) of ``vseg`` to ``backup`` at byte ``offset``."""

    token: int
    backup: int
    vseg: VirtualSegment
    offset: int
    start: int
    stop: int
    close: bool

    def parts(self):
        return self.vseg.parts(self.start, self.stop)

    @property
    def end(self) -> int:
        return self.vseg.ends[self.stop - 1] if self.stop > self.start else self.offset


class VirtualLog:
    def __init__(self, id: int, replication: int, capacity: int, backups: BackupSet,
                 timeout: float = 5.0, batch: int = REPLICATE_BATCH,
                 window: int = REPLICATE_INFLIGHT):
        self.id = id
        self.replication = replication
        self.need = max(1, replication - 1)   # backup copies: at least one disk copy, even for R=1
        self.capacity = capacity
        self.backups = backups
        self.timeout = timeout
        self.batch = batch
        self.window = window  # messages one copy may have in flight
        self.vsegs: list[VirtualSegment] = []
        self.open: VirtualSegment | None = None
        self.active: dict[int, VirtualSegment] = {}   # vsegs with replication work, by id
        self.sent: dict[int, Send] = {}               # messages in flight, by token
        self.head = 0        # index of the first vseg not wholly durable
        self.appended = 0    # refs appended, ever
        self.durable = 0     # refs on every copy, ever (a prefix)
        self.fenced = False  # a backup said this incarnation is fenced: stop
        self.messages = 0    # replicate messages built (one entry of a broker's RPC each)
        self.failures = 0
        self.give_ups = 0
        self._tokens = 0
        self._membership = -1
        self.floor = 0       # vsegs below are released: nothing live in them, files may be deleted

    # -- appends ------------------------------------------------------------------
    def append(self, segment, offset: int, length: int, body_checksum: int) -> int:
        """Reference a chunk just appended to ``segment``; returns its index in this vlog."""
        vs = self.open
        if vs is None or not vs.has_room(length):
            self.close_open(durable=False)
            vs = self.open = VirtualSegment(len(self.vsegs), self.capacity)
            self.vsegs.append(vs)
        self.active[vs.id] = vs
        vs.add(segment, offset, length, body_checksum)
        self.appended += 1
        return self.appended

    def lag(self) -> int:
        return self.appended - self.durable

    def copies_held(self) -> dict:
        held = self.vsegs[self.floor:]
        alive = self.backups.alive
        full = sum(1 for vs in held if sum(1 for b, c in vs.copies.items()
                                           if c.acked == vs.size and alive(b)) >= self.need)
        return {"vsegs": len(held), "fully_replicated": full, "released": self.floor,
                "held_bytes": sum(vs.size for vs in held)}

    # -- reclaiming ---------------------------------------------------------------------
    def done(self, vs: VirtualSegment) -> bool:
        """Closed, durable and settled on its copies: nothing more will be sent for it.

        A frozen vseg (some of its bytes left broker memory) gets no copy from here (its
        lost copies are made again from a surviving one, ``kera.broker.rebuild``); it is
        settled while ``need`` live backups hold it whole (it keeps the copies of backups
        that left, and short ones of backups that restarted with less): until its copies
        are made again, the segments sharing it stay in memory. The floor passes a frozen
        vseg once nothing in it is live, whatever its copies."""
        if not vs.closed or vs.durable < len(vs.refs):
            return False
        if vs.frozen:
            return len(vs.whole_on(self.backups.alive)) >= self.need
        return self._done(vs)

    def close_open(self, durable: bool = True) -> bool:
        """Close the open vseg; the next append opens a new one. ``durable``: only once its
        chunks are durable (retention waits on it while the vlog is idle); else at once, the
        close reaching its copies after its chunks. True if it was closed."""
        vs = self.open
        if vs is None or (durable and vs.durable < len(vs.refs)):
            return False
        vs.closed = True
        self.open = None
        self.active[vs.id] = vs
        return True

    def advance_floor(self) -> bool:
        """Release the vsegs at the bottom that hold nothing live and are settled; True if the
        floor moved (their backup files may then be deleted). An open vseg whose chunks are
        all freed is closed, so an idle vlog's last vseg is released too once its close is on
        every copy."""
        moved = False
        while self.floor < len(self.vsegs):
            vs = self.vsegs[self.floor]
            if vs.live > 0:
                break
            if vs is self.open:
                self.close_open()
            if not (vs.frozen or self.done(vs)):  # frozen: it was settled; nothing in it is needed
                break
            self.active.pop(vs.id, None)
            vs.release()
            self.floor += 1
            moved = True
        return moved

    # -- replication decisions -------------------------------------------------------
    def _done(self, vs: VirtualSegment) -> bool:
        if len(vs.copies) < self.need or vs.durable < len(vs.refs):
            return False
        return all(c.acked == vs.size and (c.closed or not vs.closed) for c in vs.copies.values())

    def poll(self, now: float, busy: Container[int] = ()) -> list[Send]:
        """The messages to send now. ``busy``: backups no message may leave for yet (the broker
        keeps at most ``REPLICATE_INFLIGHT`` replicate RPCs in flight per backup); their copies
        wait for a later poll, which then carries everything appended meanwhile."""
        if self.fenced:
            return []
        if self._membership != self.backups.version:
            self._membership = self.backups.version
            for vs in self.vsegs[self.floor:]:
                for b, c in list(vs.copies.items()):
                    if not self.backups.alive(b):
                        if not vs.frozen:  # gone: replaced at once
                            self._drop_copy(vs, b, now, avoid=False)
                        # frozen: kept (it may come back with its file); the broker's rebuilder
                        # makes the copies it needs meanwhile from one that survived
                    elif c.incarnation != self.backups.incarnation(b) and vs.frozen:
                        c.incarnation = self.backups.incarnation(b)  # it reloads its file; reads check
                    elif c.incarnation != self.backups.incarnation(b):
                        self._restarted(vs, c)
        out = []
        for vs in list(self.active.values()):
            if vs.frozen or self._done(vs):  # frozen: its bytes left memory, its copies are all
                del self.active[vs.id]
                continue
            if len(vs.copies) < self.need:
                for b in [b for b, until in vs.avoid.items() if until <= now]:
                    del vs.avoid[b]
                avoid = vs.avoid.keys()
                for b in self.backups.choose(vs.copies, avoid, self.need - len(vs.copies)):
                    vs.copies[b] = Copy(b, self.backups.incarnation(b))
            for c in vs.copies.values():
                if len(c.inflight) >= self.window or c.backup in busy or c.retry_at > now or (
                        c.acked == vs.size and (c.closed or not vs.closed)):
                    continue
                s = self._message(vs, c)
                if s is not None:
                    if not c.fails:
                        c.since = now
                    c.inflight.append(s.token)
                    c.sent = s.end
                    self.sent[s.token] = s
                    out.append(s)
        self.messages += len(out)
        return out

    def _message(self, vs: VirtualSegment, c: Copy) -> Send | None:
        """The next message of copy ``c``: from where its messages in flight end (from what it
        acknowledged if none is). A close alone leaves only with nothing else in flight (so it
        is never sent twice)."""
        offset = c.sent if c.inflight else c.acked
        start = vs.index_at(offset)
        n = len(vs.refs)
        # the refs that fit ``batch`` bytes, at least one: a search over the cumulative ends
        base = vs.ends[start - 1] if start else 0
        stop = min(n, max(start + 1, bisect_right(vs.ends, base + self.batch, start)))
        close = vs.closed and stop == n and not c.closed
        if stop == start and (not close or c.inflight):
            return None
        self._tokens += 1
        return Send(self._tokens, c.backup, vs, offset, start, stop, close)

    def next_deadline(self, now: float) -> float | None:
        """When the next backoff or avoidance after ``now`` ends (None: nothing timed is pending)."""
        times = []
        for vs in self.active.values():
            times += [c.retry_at for c in vs.copies.values() if not c.inflight and c.retry_at > now]
            if len(vs.copies) < self.need:
                times += [t for t in vs.avoid.values() if t > now]
        return min(times) if times else None

    def wanted(self, s: Send) -> bool:
        """``s`` still awaits its answer (its copy was not given up or dropped meanwhile)."""
        return self.sent.get(s.token) is s

    # -- outcomes ---------------------------------------------------------------------
    def _take(self, token: int) -> tuple[Send, Copy] | None:
        s = self.sent.pop(token, None)
        if s is None:
            return None
        c = s.vseg.copies.get(s.backup)
        if c is None or token not in c.inflight:  # given up meanwhile: a stale answer
            return None
        c.inflight.remove(token)
        return s, c

    def _forget(self, c: Copy) -> None:
        """Forget ``c``'s messages in flight (their answers will be stale): the next one is
        sent from what the copy acknowledged."""
        for t in c.inflight:
            self.sent.pop(t, None)
        c.inflight.clear()
        c.sent = c.acked

    def on_reply(self, token: int, length: int, now: float) -> bool:
        """A backup acknowledged a replicate with its copy's length; True if the head moved."""
        taken = self._take(token)
        if taken is None:
            return False
        s, c = taken
        vs = s.vseg
        if length != s.end or not vs.boundary(length):
            return self._resync(vs, c, length, now)
        c.acked = max(c.acked, length)   # answers of one copy may come out of order
        if s.close:
            c.closed = True
        c.fails, c.retry_at = 0, 0.0
        return self._confirm(vs)

    def on_error(self, token: int, now: float, *, length: int | None = None,
                 fenced: bool = False) -> bool:
        """A replicate failed. ``length``: the backup told its copy's length instead."""
        taken = self._take(token)
        if taken is None:
            return False
        s, c = taken
        if fenced:
            self.fenced = True
            return False
        if length is not None:
            return self._resync(s.vseg, c, length, now)
        self._failed(s.vseg, c, now)
        return False

    def _resync(self, vs: VirtualSegment, c: Copy, length: int, now: float) -> bool:
        """The copy holds ``length`` bytes: a prefix of ours continues from there. An answer
        may land after later ones of the same copy (the backup answered it before taking
        them): one saying less than the copy acknowledged since, its close included, is
        stale or the copy lost bytes; either way the copy is asked again from there (not
        closed any more, back among the vsegs polled even if it looked done), and the
        backup's answer says what it holds. Taken as it came, it left a closed vseg's copy
        short and the vseg never done, its segments never evicted (simulator seed 55786)."""
        if 0 <= length <= vs.size and vs.boundary(length):
            if length < c.acked:
                c.closed = False
            c.acked = length
            c.fails, c.retry_at = 0, 0.0
            self._forget(c)   # the messages after the one answered start elsewhere
            self.active[vs.id] = vs
            return self._confirm(vs)
        self._failed(vs, c, now, give_up=True)  # not our bytes: a copy that cannot be trusted
        return False

    def _failed(self, vs: VirtualSegment, c: Copy, now: float, give_up: bool = False) -> None:
        self.failures += 1
        c.fails += 1
        self._forget(c)   # the messages after the one that failed cannot fit
        if give_up or c.fails >= MAX_FAILS or now - c.since >= self.timeout:
            self._drop_copy(vs, c.backup, now, avoid=True)
        else:
            c.retry_at = now + min(BACKOFF_MAX, BACKOFF_MIN * 2 ** (c.fails - 1))

    def _drop_copy(self, vs: VirtualSegment, backup: int, now: float, avoid: bool) -> None:
        c = vs.copies.pop(backup)
        self._forget(c)
        if avoid:
            self.give_ups += 1
            vs.avoid[backup] = now + self.timeout
        self.active[vs.id] = vs

    def _restarted(self, vs: VirtualSegment, c: Copy) -> None:
        """``c``'s backup restarted: it says how much it kept (its file may hold less than it
        acknowledged) when asked from offset 0. An answer still to come from the process
        before is not about this copy: its message is forgotten, as a given-up one."""
        c.incarnation = self.backups.incarnation(c.backup)
        c.acked, c.closed, c.fails, c.retry_at = 0, False, 0, 0.0
        self._forget(c)
        self.active[vs.id] = vs

    def _confirm(self, vs: VirtualSegment) -> bool:
        if len(vs.copies) >= self.need:
            vs.confirmed = max(vs.confirmed, vs.index_at(min(c.acked for c in vs.copies.values())))
        return self._advance()

    def _advance(self) -> bool:
        """Move the durable head over confirmed refs, in vseg order; True if it moved."""
        moved = False
        while self.head < len(self.vsegs):
            vs = self.vsegs[self.head]
            if vs.confirmed > vs.durable:
                for seg, off, n in vs.refs[vs.durable:vs.confirmed]:
                    seg.durable = off + n
                self.durable += vs.confirmed - vs.durable
                vs.durable = vs.confirmed
                moved = True
            if vs.closed and vs.durable == len(vs.refs) and self._close_acked(vs):
                self.head += 1
                continue
            break
        return moved

    def _close_acked(self, vs: VirtualSegment) -> bool:
        """Every copy took the close: recovery can tell this vseg's end from a lost tail, so
        the head may pass into its successor (RAMCloud's rule for a log's segments)."""
        return len(vs.copies) >= self.need and all(c.closed for c in vs.copies.values())


def when_all_durable(waits: dict, done, failed) -> None:
    """``done()`` once every log of ``waits`` (a log with ``when_durable`` -> its index) is
    durable up to its index, or ``failed(error)`` once, at the first error (the broker's
    incarnation ended): a request that appended to several logs is answered once. With no
    waits, ``done()`` at once."""
    if not waits:
        done()
        return
    left = [len(waits)]

    def one(error) -> None:
        if left[0] <= 0:
            return
        if error is not None:
            left[0] = 0
            failed(error)
            return
        left[0] -= 1
        if not left[0]:
            done()
    for vlog, idx in waits.items():
        vlog.when_durable(idx, one)
