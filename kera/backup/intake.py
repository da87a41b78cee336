"""The replicate path: a broker's new bytes of its vseg copies, taken and answered.

A broker replicates each virtual segment of its virtual logs to R-1 backups with
``replicate`` (one RPC carries the new chunks of every copy the broker has for this
backup, each at an explicit byte offset so a resend is recognised); the backup verifies
every chunk's checksums (one call per chunk, never per record), keeps the payload in
memory as it came, and answers once the bytes are where ``--fsync`` wants them: in
memory (``periodic``), written to the segment file (``write``, the default) or written
and fsynced (``always``). What is stored, acknowledged again or refused is the store's
decision (``kera.backup.store``); the waits for the disk are the flusher's rounds
(``kera.backup.flushing``).

Failures are never silent: a write error is remembered on its replica and reported to
the next replicate (periodic mode) or to the waiting one (always mode); while the disk
is failing no new segment is accepted; ``--max-bytes`` is checked before data is
accepted, so a full disk refuses data up front.
"""

from __future__ import annotations

from bisect import bisect_left

import trio

from .. import limits
from ..errors import BackupError, InvalidArgument, KeraError, LimitExceeded
from .fields import vseg_key
from .flushing import Flusher
from .replica import Replica
from .store import DUPLICATE, EMPTY, NEW, BackupStore, scan_payload


def _stable(payload) -> memoryview:
    """The payload as a byte view that nobody can change (no copy if it is one)."""
    mv = memoryview(payload)
    if isinstance(mv.obj, bytes) and mv.c_contiguous:
        return mv.cast("B") if mv.format != "B" else mv
    return memoryview(bytes(mv))


def _scans(mv: memoryview, starts: list[int], sizes: list[int]) -> list:
    """The chunks of each entry (``sizes`` bytes at ``starts`` of ``mv``) from one scan of
    the whole payload: its per-call cost is paid once per RPC, not once per entry. All None
    (each entry is then verified alone, for its own error) unless the payload is whole valid
    chunks and every entry starts at one of them."""
    try:
        heads, offs = scan_payload(mv)
    except KeraError:
        return [None] * len(starts)
    out = []
    for st, sz in zip(starts, sizes, strict=True):
        if not sz:
            out.append(None)
            continue
        i = bisect_left(offs, st)
        if i == len(offs) or offs[i] != st:
            return [None] * len(starts)
        j = bisect_left(offs, st + sz, i)
        out.append((heads[i:j], [o - st for o in offs[i:j]]))
    return out


class Intake:
    """Replicates taken into the ``store`` and answered once durable as the ``flusher``'s
    --fsync mode wants; handed the service's ``counters``. ``stopping``: set as the backup
    stops, after which nothing new is taken."""

    def __init__(self, store: BackupStore, counters: dict, flusher: Flusher):
        self.store, self.counters, self.flusher = store, counters, flusher
        self.stopping = False

    def replicate(self, meta: dict, payload):
        """New bytes of one vseg copy, or (with ``entries``) of every copy a broker has for
        this backup: [vlog, vseg, offset, close, length] each, over consecutive parts of the
        payload. Each entry is taken or refused by the store's rules on its own; a batch is
        answered at once, after one durability wait for all its entries, with each one's
        length or typed error. A malformed request is refused whole and stores nothing."""
        self.counters["replicate_rpcs"] += 1
        try:
            if self.stopping:
                raise BackupError("backup shutting down")
            batch = "entries" in meta
            epoch = meta.get("epoch") or 0
            if not batch and (meta.get("vlog") is None or meta.get("vseg") is None
                              or meta.get("offset") is None):
                raise InvalidArgument("replicate needs entries, or vlog, vseg and offset")
            entries = self._entries(meta, payload) if batch else [
                (vseg_key(meta), meta["offset"], meta.get("close") is True, _stable(payload), None)]
        except KeraError:
            self.counters["errors"] += 1
            raise
        self.counters["replicate_entries"] += len(entries)
        results: list = [0] * len(entries)   # each entry's length, or its error
        waits: list[tuple[int, Replica, int, bool]] = []   # entries answered once on disk
        new: list[Replica] = []                            # replicas whose files are to be made
        for i, (key, offset, close, data, scans) in enumerate(entries):
            try:
                d = self.store.replicate(key, epoch, offset, data, close, scans)
            except KeraError as e:
                self.counters["errors"] += 1
                results[i] = e
                continue
            if d.kind == EMPTY:
                continue
            if d.kind == DUPLICATE:
                self.counters["duplicates"] += 1
            else:
                self.counters["chunks"] += d.chunks
                self.counters["bytes_received"] += d.take
            if d.kind == NEW:
                d.replica.ready = trio.Event()
                new.append(d.replica)
            if self._acked(d.replica, d.length, close):
                results[i] = d.length
            else:
                waits.append((i, d.replica, d.length, close))
        if waits and not new and self.flusher.write_through and self.flusher.write_now():
            waits = self._settle(waits, results)
        if new or waits:
            return self._answer_later(batch, results, waits, new)
        return self._answer(batch, results)

    def _entries(self, meta: dict, payload) -> list[tuple]:
        """A batch's entries as (key, offset, close, bytes, their chunks if scanned): adding up
        to the payload, or an ``InvalidArgument`` (nothing stored)."""
        broker, entries = meta["broker"], meta["entries"]
        mv = _stable(payload)
        if mv.nbytes > limits.MAX_REPLICATE_PAYLOAD:
            raise LimitExceeded(f"replicate payload of {mv.nbytes} bytes exceeds "
                                f"{limits.MAX_REPLICATE_PAYLOAD}", limit="MAX_REPLICATE_PAYLOAD",
                                bound=limits.MAX_REPLICATE_PAYLOAD, size=mv.nbytes)
        starts, pos = [], 0
        for e in entries:
            starts.append(pos)
            pos += e[4]
        if pos != mv.nbytes:
            raise InvalidArgument(f"replicate entries add up to {pos} bytes, the payload has "
                                  f"{mv.nbytes}")
        sizes = [e[4] for e in entries]
        return [((broker, e[0], e[1]), e[2], e[3], mv[o:o + n], scan)
                for e, o, n, scan in zip(entries, starts, sizes, _scans(mv, starts, sizes),
                                         strict=True)]

    @staticmethod
    def _answer(batch: bool, results: list):
        if batch:
            return {"results": [r.to_wire() if isinstance(r, KeraError) else r for r in results]}
        if isinstance(results[0], KeraError):
            raise results[0]
        return {"length": results[0]}

    def _acked(self, rep: Replica, end: int, close: bool) -> bool:
        """Whether an entry may be answered: its replica's file exists and its bytes (and close)
        are where the --fsync mode wants them; a replica that failed raises why."""
        if not rep.ready.is_set():
            return False
        if rep.failed:
            raise BackupError(rep.failed)
        if self.flusher.always:
            if rep.synced >= end and (not close or rep.trailer_synced):
                return True
        elif self.flusher.write_through:
            if rep.flushed >= end and (not close or rep.trailer_written):
                return True
        else:
            return True
        if rep.dropped:
            raise BackupError(f"replica {rep.key} was dropped")
        if rep.error:
            raise BackupError(f"replica {rep.key}: {rep.error}")
        return False

    async def _answer_later(self, batch: bool, results: list, waits: list, new: list[Replica]):
        """Create the new replicas' files, then wait for the flusher until every waiting entry is
        on disk or failed: one round serves them all."""
        with trio.CancelScope(shield=True):  # a creation is finished even if the caller goes away
            for rep in new:
                await self.flusher.create(rep)
        while waits:
            for _, rep, _, _ in waits:
                if not rep.ready.is_set():
                    await rep.ready.wait()  # a file another replicate is creating
            if waits := self._settle(waits, results):
                await self.flusher.next_round()
        return self._answer(batch, results)

    def _settle(self, waits: list, results: list) -> list:
        """Each waiting entry's result if it may be answered now (its length, or why not);
        returns those still waiting."""
        pending = []
        for w in waits:
            i, rep, end, close = w
            try:
                if self._acked(rep, end, close):
                    results[i] = end
                else:
                    pending.append(w)
            except BackupError as e:
                self.counters["errors"] += 1
                results[i] = e
        return pending
