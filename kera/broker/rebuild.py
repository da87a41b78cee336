"""Rebuilding a frozen vseg's lost copies from a copy that survived.

A vseg is *frozen* once some of its chunks left broker memory (eviction,
retention, compaction): the vlog can no longer send its bytes, so a backup
lost afterwards would leave it one copy short for good, and the next losses
would take acknowledged records with them. A frozen vseg keeps the copy of
a backup that left (``VirtualLog.poll``): it may come back with its file.
A backup that restarted reloaded its copies from its files, which may hold
less than it acknowledged (a tail not yet on disk under ``--fsync
periodic``, a torn write): the rebuilder asks it what it holds (``list``) and
no longer counts a frozen copy it lists short, not closed or damaged as whole
(``verify``). A backup that found a corrupt chunk on its disk (a read, its
scrubber: ``kera.backup.scrub``) says so in its heartbeats (``damage``) and is
asked the same way. A damaged copy cannot be mended in place (the backup takes
a resend of bytes it holds as a duplicate), so it is made on another backup.
A frozen vseg none of whose known copies is on a live backup may still be
whole on one the vlog gave up on (slow, its copy moved elsewhere, what it
had been sent landing there after all): the live backups' listings are read
for such orphans, and a copy listed closed, whole and undamaged is their
source again (``found``).
After each membership change the rebuilder finds every frozen vseg with
fewer whole copies on live backups than the vlog needs, picks new backups as
for any copy (``BackupSet.choose``) and fills each from a surviving copy,
piece by piece: ``read`` from the source (verified there), checked here
against what the vseg recorded when its chunks were appended (each chunk's
offset, size and body checksum, so only our own bytes are copied), then
``replicate`` to the new backup at the same offsets, the last piece with the
close. To the new backup it is a copy like any other, and a recovery lists
and replays it as one. The new copy counts once the backup acknowledged the
close; a copy cut short is a prefix of the same bytes, continued from its
length on the same backup when it is tried again.

Pieces are whole chunks of at most ``limits.MAX_READ`` bytes (a read reply), one vseg at a time per
broker: memory and bandwidth are bounded however many vsegs lost a copy. A
pass that could not make every copy (a backup failing, none to copy to) is
tried again, backing off; a target that failed is avoided for the vlog's
replicate timeout, for every vseg (a failing source is asked last). Adopted segments' vsegs (a dead
incarnation's, ``kera.broker.adopted``) are not ours to rebuild: their
copies are claimed, not written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from .. import chunk, limits
from ..errors import BackupError, ChecksumError, Fenced, KeraError, ProtocolError
from ..vlog.virtual_segment import Copy

log = logging.getLogger("kera.broker")

TIMEOUT = 10.0            # a restarted backup's listing
RETRY = 1.0               # after a pass that left copies to make, the next one (sooner if
MAX_RETRY = 30.0          # membership changes), doubling while passes keep falling short


def listed(segments: list) -> dict:
    """A backup's listing by (vlog, vseg): its well-formed entries (a dict with integer ids);
    anything else in it is no copy at all. It runs outside the listing call's error
    handling, so nothing in an entry may raise here."""
    return {(s["vlog"], s["vseg"]): s for s in segments
            if isinstance(s, dict) and type(s.get("vlog")) is int and type(s.get("vseg")) is int}


def listed_whole(s: dict, size: int) -> bool:
    """Listed closed, at ``size`` bytes, with no corrupt chunk and no error."""
    return s.get("closed") is True and type(s.get("length")) is int and s["length"] == size \
        and not s.get("corrupt") and not s.get("error")


class SourceFailed(BackupError):
    """No surviving copy could give the rest of the vseg: the target is not to blame."""


class Rebuilder:
    """One broker incarnation's rebuilding of frozen vsegs' lost copies (``run`` in its nursery)."""

    def __init__(self, pool, identity: Callable[[], tuple[int, int]], addr_of: Callable[[int], str],
                 backups, vlogs: Callable[[], Iterable], damage: Callable[[], dict[int, int]]):
        self.pool = pool
        self.identity = identity    # (broker id, epoch): the replicas' names, the writes' epoch
        self.addr_of = addr_of      # backup id -> address (raises Unavailable if not alive)
        self.backups = backups      # the broker's BackupSet: who is alive, where copies go
        self.vlogs = vlogs          # () -> the incarnation's Replicators
        self.damage = damage        # () -> live backup -> corrupt chunks it found on its disk
        self.wake = trio.Event()
        self.rebuilt = 0            # copies made again
        self.bytes = 0
        self.failures = 0
        self.under = 0              # frozen vsegs short of copies after the last pass
        self.short: dict = {}       # vsegs with no whole copy on a live backup -> (vlog id, vseg id)
        self.partial: dict = {}     # vseg -> the backup its last copy was cut short on (a prefix)
        self.avoid: dict[int, float] = {}   # backups whose copy failed -> until when
        self.seen: dict[int, tuple] = {}    # backup -> (incarnation, damage) at the last pass
        self.damaged: dict = {}     # vseg -> backups whose copy of it has a corrupt chunk
        self.dropped = 0            # frozen copies a restarted backup no longer held whole (counted)
        self.searched: dict[int, tuple] = {}   # backup -> (incarnation, orphans) its listing was read for
        self.strays = 0             # whole copies found that the vlog had given up on (taken again)
        self.delay = RETRY

    def poke(self) -> None:
        """Membership changed: some frozen vseg may have lost a copy, or got one back."""
        self.wake.set()

    def stats(self) -> dict:
        """Counters as of the last pass (heartbeats ask often: no walk over the vsegs here)."""
        return {"rebuilt": self.rebuilt, "rebuilt_bytes": self.bytes, "rebuild_failures": self.failures,
                "under_replicated": self.under, "without_copy": len(self.short),
                "dropped": self.dropped, "strays": self.strays}

    def whole(self, vs) -> list[int]:
        """Backups alive now holding ``vs`` whole and closed, none of its chunks corrupt there."""
        bad = self.damaged.get(vs, ())
        return [b for b in vs.whole_on(self.backups.alive) if b not in bad]

    def todo(self) -> list:
        """(replicator, vseg) of every frozen vseg below its vlog's need of whole live copies."""
        out = []
        for r in self.vlogs():
            v = r.log
            for vs in v.vsegs[v.floor:]:
                if vs.frozen and vs.closed and not vs.released and vs.size and vs.live > 0 and \
                        len(self.whole(vs)) < v.need:
                    out.append((r, vs))
        return out

    def orphans(self) -> list:
        """(replicator, vseg) of the frozen vsegs to rebuild that no live backup holds whole as
        far as their vlog knows: nothing to copy from, unless a backup holds a stray copy."""
        return [(r, vs) for r, vs in self.todo() if not self.whole(vs)]

    def to_search(self, orphans: list) -> list[int]:
        """Live backups whose listing may hold a stray whole copy of ``orphans``: each asked
        once per incarnation while the orphans stay the same (``found`` records it)."""
        key = frozenset((r.log.id, vs.id) for r, vs in orphans)
        return [b for b, e in self.backups.epochs.items() if self.searched.get(b) != (e, key)] \
            if orphans else []

    def found(self, backup: int, segments: list, orphans: list) -> int:
        """Stray copies in ``backup``'s listing: a copy of one of ``orphans`` it lists closed, at
        the vseg's size and undamaged is taken as a copy again, so the vseg has a source. The
        vlog gives up on a copy whose backup is slow (it moves the copy elsewhere), yet what
        it had sent may still land there whole; once the copies it moved to are lost, that
        stray is the one left. Its chunks are checked against the vseg's record as they are
        read (``_check``), as any source's. Returns how many were taken."""
        self.searched[backup] = (self.backups.incarnation(backup),
                                 frozenset((r.log.id, vs.id) for r, vs in orphans))
        held = listed(segments)
        n = 0
        for r, vs in orphans:
            s = held.get((r.log.id, vs.id))
            if s is None or not listed_whole(s, vs.size) or backup in self.damaged.get(vs, ()) \
                    or vs.released:
                continue
            c = vs.copies.get(backup) or Copy(backup, self.backups.incarnation(backup))
            c.acked, c.closed = vs.size, True
            vs.copies[backup] = c
            n += 1
            log.warning("vlog %d vseg %d: backup %d holds a whole copy the vlog had given up on, "
                        "and no other live backup does: taken as a source", r.log.id, vs.id, backup)
        self.strays += n
        return n

    def changed(self) -> list[int]:
        """Backups alive now that restarted since the last pass (a new incarnation: they
        reloaded our frozen copies from their files, which may hold less than was acknowledged,
        a tail not yet on disk under ``--fsync periodic``, a torn write) or found more corrupt
        chunks on their disk."""
        found = self.damage()
        now = {b: (e, found.get(b, 0)) for b, e in self.backups.epochs.items()}
        out = [b for b, k in now.items() if self.seen.get(b) != k]   # unseen too: asked once
        self.seen.update(now)   # a backup that left is remembered: back, it is asked too
        return out

    def frozen_on(self, backup: int) -> set:
        """The frozen vsegs with a copy on ``backup``."""
        return {vs for r in self.vlogs() for vs in r.log.vsegs[r.log.floor:]
                if vs.frozen and backup in vs.copies}

    def verify(self, backup: int, segments: list, only: set | None = None) -> int:
        """``backup``'s listing of our replicas after a restart or damage found: a frozen copy
        (of ``only``, those frozen when it was asked) it lists short, not closed, failing or
        with a corrupt chunk is no whole copy any more, so it is made again (a short one on
        that backup, from the length it holds; a damaged one elsewhere). It stays at that
        length (reads still find its intact chunks there); one not listed at all is dropped.
        A damaged copy of a vseg not frozen yet is remembered, not counted once it freezes.
        Returns how many whole copies were lost."""
        held = listed(segments)
        lost = 0
        for r in self.vlogs():
            v = r.log
            for vs in v.vsegs[v.floor:]:
                s = held.get((v.id, vs.id))
                counted = backup not in self.damaged.get(vs, ())
                if s is not None and backup in vs.copies and (s.get("corrupt") or s.get("error")):
                    self.damaged.setdefault(vs, set()).add(backup)
                c = vs.copies.get(backup) if vs.frozen and (only is None or vs in only) else None
                if c is None:
                    continue
                was = c.closed and c.acked == vs.size and counted
                if s is None:
                    del vs.copies[backup]
                elif not listed_whole(s, vs.size):
                    length = s.get("length")
                    c.acked = min(length, vs.size) if type(length) is int and length >= 0 else 0
                    c.closed = False
                else:
                    continue
                lost += was
        if lost:
            log.warning("backup %d holds %d of our frozen copies short or damaged: made "
                        "again", backup, lost)
        self.dropped += lost
        return lost

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            now = trio.current_time()
            self.avoid = {b: t for b, t in self.avoid.items() if t > now}
            short = False
            for b in self.changed():
                short |= not await self._verify(b)
            orphans = self.orphans()
            for b in self.to_search(orphans):
                short |= not await self._search(b, orphans)
            for r, vs in self.todo():
                try:
                    short |= not await self.rebuild(r, vs)
                except Fenced:
                    raise
                except KeraError as e:
                    short = True
                    self.failures += 1
                    log.warning("vlog %d vseg %d: rebuilding a lost copy failed: %s", r.log.id, vs.id, e)
            self.under = len(self.todo())
            self.short = {vs: k for vs, k in self.short.items() if not vs.released}
            self.partial = {vs: b for vs, b in self.partial.items() if not vs.released}
            self.damaged = {vs: bs for vs, bs in self.damaged.items() if not vs.released}
            if short:
                with trio.move_on_after(self.delay):
                    await self.wake.wait()
                self.delay = min(self.delay * 2, MAX_RETRY)
                self.wake.set()
            else:
                self.delay = RETRY

    async def rebuild(self, r, vs) -> bool:
        """Make ``vs`` whole again on as many new backups as its vlog needs; False if some
        copies are still to make (no source, no backup to copy to)."""
        v = r.log
        if vs.released:
            return True
        sources = self.whole(vs)
        if not sources:
            if vs not in self.short:
                self.short[vs] = (v.id, vs.id)
                log.error("vlog %d vseg %d is frozen and no live backup holds it whole: no copy can "
                          "be made unless a backup holding it comes back", v.id, vs.id)
            return False
        self.short.pop(vs, None)
        sources.sort(key=lambda b: b in self.avoid)   # one that failed lately is asked last
        want = v.need - len(sources)
        targets = self.targets(vs, want)
        counted = 0
        for t in targets:
            self.partial[vs] = t
            inc = self.backups.incarnation(t)
            try:
                done = await self._copy(r, vs, sources, t)
            except (Fenced, SourceFailed):
                raise
            except KeraError:   # the target failed: another one next time, for a while
                self.avoid[t] = trio.current_time() + v.timeout
                raise
            if not done:   # released meanwhile: nothing live in it, its files may go
                await self._trim(r, t)
                return True
            if not self.made(vs, t, inc):
                continue
            counted += 1
            log.info("vlog %d vseg %d: copy made again on backup %d from backup %d (%d bytes)",
                     v.id, vs.id, t, sources[0], vs.size)
        return counted >= want

    def made(self, vs, target: int, incarnation: int) -> bool:
        """``vs`` was written whole and closed to ``target``, which was ``incarnation`` when the
        copy began: counted as a copy only if that same process is alive now. One that
        restarted meanwhile may not have kept what it acknowledged (a torn tail under
        ``--fsync periodic``), yet counted under its new incarnation it was never asked
        (simulator seed 58572); not counted, the next pass goes on there from what it holds."""
        if vs.released or not self.backups.alive(target) or \
                self.backups.incarnation(target) != incarnation:
            return False
        c = vs.copies[target] = Copy(target, incarnation)
        c.acked, c.closed = vs.size, True
        self.partial.pop(vs, None)
        self.rebuilt += 1
        return True

    def targets(self, vs, want: int) -> list[int]:
        """Up to ``want`` backups to make copies of ``vs`` on: first those holding a prefix
        (its last copy cut short there, or a short copy a restarted backup kept), continued
        from their length, then others as for any copy; none avoided, none holding a damaged
        copy of it (the bytes it holds are taken as a resend there: never mended)."""
        whole = self.whole(vs)
        bad = self.damaged.get(vs, set())
        out: list[int] = []
        for t in [self.partial.get(vs), *sorted(vs.copies)]:
            if t is not None and t not in out and t not in whole and t not in bad \
                    and self.backups.alive(t) and t not in self.avoid and len(out) < want:
                out.append(t)
        if want > len(out):
            out += self.backups.choose([*whole, *out, *bad], self.avoid, want - len(out))
        return out

    async def _copy(self, r, vs, sources: list[int], target: int) -> bool:
        """Write ``vs`` whole and closed to ``target``; False if it was released meanwhile."""
        broker, epoch = self.identity()
        key = {"broker": broker, "vlog": r.log.id, "vseg": vs.id}
        timeout = r.log.timeout
        off, src = 0, 0
        while True:
            if vs.released:
                return False
            if off == vs.size:   # the target said it holds every byte (an answer lost, a copy
                data = memoryview(b"")   # not counted): the close alone, as the vlog sends one
            else:
                if src >= len(sources):
                    raise SourceFailed(f"no copy could give vseg {vs.id} of vlog {r.log.id} "
                                       f"from offset {off}")
                data = await self._read(key, sources[src], vs, off, timeout)
                if data is None:   # this source is corrupt or failing there: the next one
                    src += 1
                    continue
                if vs.released:
                    return False
            close = off + len(data) == vs.size
            try:
                a, _ = await self.pool.call(self.addr_of(target), "replicate", {
                    **key, "epoch": epoch, "offset": off, "close": close}, parts=[data], timeout=timeout)
            except KeraError as e:
                length = getattr(e, "length", None)
                if type(length) is int and length != off and 0 <= length <= vs.size and vs.boundary(length):
                    off = length   # it holds a prefix of the same bytes already: go on from its end
                    continue
                raise
            if a.get("length") != off + len(data):
                raise ProtocolError(f"replicate answered {a!r:.80} for {off + len(data)} bytes")
            self.bytes += len(data)
            off += len(data)
            if close:
                return True

    async def _read(self, key: dict, source: int, vs, off: int, timeout: float) -> memoryview | None:
        """The whole chunks of ``vs`` from ``off`` (at most ``limits.MAX_READ`` bytes, at least one chunk)
        as ``source`` holds them, checked against the vseg's record; None if it cannot give them."""
        try:
            meta, payload = await self.pool.call(self.addr_of(source), "read", {
                **key, "offset": off, "max_bytes": limits.MAX_READ}, timeout=timeout)
            data = memoryview(b"".join(payload) if isinstance(payload, list) else bytes(payload))
            if not data:
                raise BackupError(f"read at {off} returned nothing (corrupt at {meta.get('corrupt_at')})")
            self._check(vs, off, data)   # released meanwhile: its record is gone, this fails
            return data
        except (KeraError, ProtocolError) as e:
            if isinstance(e, ChecksumError):   # its copy is damaged: not whole, not to be mended
                self.damaged.setdefault(vs, set()).add(source)
            else:   # failing, not this vseg's bytes: asked last a while
                self.avoid[source] = trio.current_time() + timeout
            log.warning("vseg %d from backup %d at %d: %s", vs.id, source, off, e)
            return None

    async def _listing(self, backup: int, why: str) -> list | None:
        """``backup``'s listing of our replicas (``list``); None if it could not be asked."""
        broker, _ = self.identity()
        try:
            r, _ = await self.pool.call(self.addr_of(backup), "list", {"broker": broker},
                                        timeout=TIMEOUT)
            segments = r["segments"]
            if not isinstance(segments, list):
                raise ProtocolError(f"a listing of {type(segments).__name__}")
            return segments
        except (KeraError, KeyError, TypeError, AttributeError) as e:
            log.warning("backup %d: its listing (%s) failed: %s", backup, why, e)
            return None

    async def _verify(self, backup: int) -> bool:
        """Ask a backup that restarted or found damage what it holds (``list``) and ``verify``
        it; False if it could not be asked (asked again on the next pass)."""
        only = self.frozen_on(backup)   # frozen after the listing was made: not judged by it
        segments = await self._listing(backup, "it restarted or found damage")
        if segments is None:
            self.seen[backup] = -1   # taken as restarted again next pass
            return False
        self.verify(backup, segments, only)
        return True

    async def _search(self, backup: int, orphans: list) -> bool:
        """Read a live backup's listing for stray copies of ``orphans`` (``found``); False if it
        could not be asked (asked again on the next pass)."""
        inc = self.backups.incarnation(backup)
        segments = await self._listing(backup, "a stray copy of a vseg with none known")
        if segments is None:
            return False
        if self.backups.incarnation(backup) == inc:   # else restarted meanwhile: asked again
            self.found(backup, segments, orphans)
        return True

    async def _trim(self, r, backup: int) -> None:
        """The vlog's floor to ``backup``, which may hold a file of a vseg released during its
        copy (else that file waits for the vlog's next trim, as on a backup that was down)."""
        broker, _ = self.identity()
        try:
            await self.pool.call(self.addr_of(backup), "trim", {
                "broker": broker, "vlog": r.log.id, "floor": r.log.floor}, timeout=r.log.timeout)
        except KeraError as e:
            log.info("vlog %d: trim to vseg %d on backup %d failed: %s", r.log.id, r.log.floor, backup, e)

    @staticmethod
    def _check(vs, off: int, data: memoryview) -> None:
        """Every chunk is intact (checksums) and is the one the vseg recorded at its offset."""
        k = vs.index_at(off)
        if k and vs.ends[k - 1] != off:
            raise ChecksumError(f"offset {off} is not a chunk boundary of vseg {vs.id}")
        for h, pos in chunk.scan(data):
            start = vs.ends[k - 1] if k else 0
            if k >= len(vs.ends) or start != off + pos or vs.ends[k] - start != h.size \
                    or vs.sums[k] != h.body_checksum:
                raise ChecksumError(f"chunk at {off + pos} of vseg {vs.id} is not the one appended there")
            k += 1
