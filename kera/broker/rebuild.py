"""Rebuilding a frozen vseg's lost copies from a copy that survived.

A vseg is *frozen* once some of its chunks left broker memory (eviction,
retention, compaction): the vlog can no longer send its bytes, so a backup
lost afterwards would leave it one copy short for good, and the next losses
would take acknowledged records with them. After a membership change the
rebuilder finds every frozen vseg with fewer whole copies on live backups
than the vlog needs, picks new backups as for any copy (``BackupSet.choose``)
and fills each from a surviving copy, piece by piece: ``read`` from the
source (verified there), checked here against what the vseg recorded when its
chunks were appended (each chunk's size and body checksum, so a copy can only
be made of our own bytes), then ``replicate`` to the new backup at the same
offsets, the last piece with the close. To the new backup it is a copy like
any other, and a recovery lists and replays it as one. The new copy is
counted only once the backup acknowledged the close; a copy that failed
halfway is a prefix of the same bytes, continued from its length next time.

Pieces are whole chunks of at most ``PIECE`` bytes, one vseg at a time per
broker: memory and bandwidth are bounded however many vsegs lost a copy.
Adopted segments' vsegs (a dead incarnation's, ``kera.broker.adopted``) are
not ours to rebuild: their copies are claimed, not written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from .. import chunk, limits
from ..errors import BackupError, ChecksumError, Fenced, KeraError, ProtocolError
from ..vlog.virtual_segment import Copy

log = logging.getLogger("kera.broker")

PIECE = limits.REPLICATE_RPC   # bytes read from the source and written to the new copy at once
TIMEOUT = 30.0
RETRY = 1.0                    # after a failed pass, the next one (sooner if membership changes),
MAX_RETRY = 30.0               # doubling while passes keep failing


class Rebuilder:
    """One broker incarnation's rebuilding of frozen vsegs' lost copies (``run`` in its nursery)."""

    def __init__(self, pool, identity: Callable[[], tuple[int, int]], addr_of: Callable[[int], str],
                 backups, vlogs: Callable[[], Iterable]):
        self.pool = pool
        self.identity = identity    # (broker id, epoch): the replicas' names, the writes' epoch
        self.addr_of = addr_of      # backup id -> address (raises Unavailable if not alive)
        self.backups = backups      # the broker's BackupSet: who is alive, where copies go
        self.vlogs = vlogs          # () -> the incarnation's Replicators
        self.wake = trio.Event()
        self.rebuilt = 0            # copies made again
        self.bytes = 0
        self.failures = 0
        self.short: dict = {}       # vsegs with no whole copy left on a live backup -> (vlog id, vseg id)
        self.partial: dict = {}     # vseg -> the backup its last copy was cut short on (a prefix)
        self.delay = RETRY

    def poke(self) -> None:
        """Membership changed: some frozen vseg may have lost a copy."""
        self.wake.set()

    def stats(self) -> dict:
        return {"rebuilt": self.rebuilt, "rebuilt_bytes": self.bytes, "rebuild_failures": self.failures,
                "under_replicated": sum(1 for _ in self.todo()), "without_copy": len(self.short)}

    def whole(self, vs) -> list[int]:
        """Backups alive now holding ``vs`` whole and closed."""
        return [b for b, c in vs.copies.items()
                if c.closed and c.acked == vs.size and self.backups.alive(b)]

    def todo(self):
        """(replicator, vseg) of every frozen vseg below its vlog's need of whole live copies."""
        for r in self.vlogs():
            v = r.log
            for vs in v.vsegs[v.floor:]:
                if vs.frozen and vs.closed and not vs.released and vs.size and \
                        len(self.whole(vs)) < v.need:
                    yield r, vs

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            failed = False
            for r, vs in list(self.todo()):
                try:
                    await self.rebuild(r, vs)
                except Fenced:
                    raise
                except KeraError as e:
                    failed = True
                    self.failures += 1
                    log.warning("vlog %d vseg %d: rebuilding a lost copy failed: %s", r.log.id, vs.id, e)
            self.short = {vs: k for vs, k in self.short.items() if not vs.released}
            self.partial = {vs: b for vs, b in self.partial.items() if not vs.released}
            if failed:   # tried again later, backing off while it keeps failing
                with trio.move_on_after(self.delay):
                    await self.wake.wait()
                self.delay = min(self.delay * 2, MAX_RETRY)
                self.wake.set()
            else:
                self.delay = RETRY

    async def rebuild(self, r, vs) -> None:
        """Make ``vs`` whole again on as many new backups as its vlog needs. A backup that
        fails is avoided for a while (as the vlog avoids one); one left with a prefix is
        continued first."""
        v = r.log
        if vs.released:
            return
        sources = self.whole(vs)
        if not sources:
            if vs not in self.short:
                self.short[vs] = (v.id, vs.id)
                log.error("vlog %d vseg %d is frozen and no live backup holds it whole: no copy can "
                          "be made until one comes back", v.id, vs.id)
            return
        self.short.pop(vs, None)
        now = trio.current_time()
        for b in [b for b, until in vs.avoid.items() if until <= now]:
            del vs.avoid[b]
        holding = [b for b in vs.copies if self.backups.alive(b)]
        targets = []
        t = self.partial.get(vs)
        if t is not None and self.backups.alive(t) and t not in vs.copies and t not in vs.avoid:
            targets.append(t)
        targets += self.backups.choose(holding + targets, vs.avoid, v.need - len(sources) - len(targets))
        for t in targets:
            self.partial[vs] = t
            try:
                await self._copy(r, vs, sources, t)
            except KeraError:
                vs.avoid[t] = trio.current_time() + v.timeout
                raise
            del self.partial[vs]
            if vs.released:   # nothing live in it any more: the next trim deletes the new file
                r.trimmed = min(r.trimmed, vs.id)
                r.poke()
                return
            c = vs.copies[t] = Copy(t, self.backups.incarnation(t))
            c.acked, c.closed = vs.size, True
            self.rebuilt += 1
            log.info("vlog %d vseg %d: copy made again on backup %d from backup %d (%d bytes)",
                     v.id, vs.id, t, sources[0], vs.size)

    async def _copy(self, r, vs, sources: list[int], target: int) -> None:
        broker, epoch = self.identity()
        key = {"broker": broker, "vlog": r.log.id, "vseg": vs.id}
        off, src = 0, 0
        while True:
            if not 0 <= src < len(sources):
                raise BackupError(f"no source could give vseg {vs.id} from offset {off}")
            data = await self._read(key, sources[src], vs, off)
            if data is None:   # this source is corrupt or failing there: the next one
                src += 1
                continue
            close = off + len(data) == vs.size
            try:
                a, _ = await self.pool.call(self.addr_of(target), "replicate", {
                    **key, "epoch": epoch, "offset": off, "close": close}, parts=[data], timeout=TIMEOUT)
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
                return

    async def _read(self, key: dict, source: int, vs, off: int) -> memoryview | None:
        """The whole chunks of ``vs`` from ``off`` (at most ``PIECE`` bytes, at least one chunk)
        as ``source`` holds them, checked against the vseg's record; None if it cannot give them."""
        try:
            meta, payload = await self.pool.call(self.addr_of(source), "read", {
                **key, "offset": off, "max_bytes": PIECE}, timeout=TIMEOUT)
            data = memoryview(b"".join(payload) if isinstance(payload, list) else bytes(payload))
            if not data:
                raise BackupError(f"read at {off} returned nothing (corrupt at {meta.get('corrupt_at')})")
            self._check(vs, off, data)
            return data
        except (KeraError, ProtocolError) as e:
            log.warning("vseg %d from backup %d at %d: %s", vs.id, source, off, e)
            return None

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
