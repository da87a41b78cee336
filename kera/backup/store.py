"""BackupStore: what a backup decides, apart from doing it (sans-IO).

No trio, no files, no clock: the replica registry, the broker fences and the
byte accounting, and the rules applied to them. Which replicate is stored,
acknowledged again or refused (offsets, duplicates, close, fencing by broker
epoch, limits and budgets), what a flush round writes and what its outcome
changes, what a read at an offset returns, what a drop takes out of service.
``service.BackupService`` does the I/O and the RPCs around it, so these rules
are tested without processes (tests/test_backup_store.py).

Every refusal is raised before anything changes: a refused replicate stores
nothing. An offset the copy cannot take raises a ``BackupError`` whose
``length`` attribute is the copy's length; the broker's virtual log resends
from there.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import chunk as chunkfmt
from .. import limits
from ..errors import (
    BackupError,
    ChecksumError,
    Fenced,
    InvalidArgument,
    LimitExceeded,
    ProtocolError,
)
from ..wire.columns import PLAIN_COLUMNS
from . import segment_file
from .replica import Replica

DEFAULT_MAX_MEMORY = 1 << 30     # unflushed bytes; flushed ones are released under pressure

Key = tuple[int, int, int]

# What a replicate does (Decision.kind).
EMPTY = "empty"          # no replica and nothing to store: acknowledge length 0
DUPLICATE = "duplicate"  # bytes the copy holds already: acknowledge them again
NEW = "new"              # a new replica (its file is to be created)
APPEND = "append"        # bytes (and maybe the close) at the copy's end
CLOSE = "close"          # a resend whose close is new: only the close is stored


def length_error(msg: str, length: int) -> BackupError:
    """An offset the replica cannot take: the broker resends from ``length``."""
    err = BackupError(f"{msg}; length={length}")
    err.length = length  # crosses the wire once KeraError.to_wire sends extra attributes
    return err


def scan_payload(mv: memoryview):
    """The payload's chunks verified in one pass: (headers as an array, offsets); refused
    unless all whole and valid."""
    try:
        return chunkfmt.scan_headers(mv)
    except ChecksumError as e:
        raise ChecksumError(f"replicate payload: {e}; nothing stored") from None
    except ProtocolError as e:
        raise InvalidArgument(f"replicate payload is not whole valid chunks: {e}; nothing stored") from None


@dataclass(slots=True)
class Decision:
    """One replicate's fate; ``length`` is what it acknowledges once stored (and on disk if asked)."""

    kind: str
    key: Key
    epoch: int
    replica: Replica | None  # None until a NEW one is committed
    length: int
    take: int = 0            # payload bytes to store
    close: bool = False      # the replicate asks for the close (new or already done)
    chunks: int = 0          # chunks stored

    @property
    def stores(self) -> bool:
        return self.kind in (NEW, APPEND, CLOSE)


class FlushJob(NamedTuple):
    replica: Replica
    start: int               # the file holds the chunk area up to here
    upto: int                # ... and up to here once ``parts`` are written
    parts: list              # memoryviews of [start, upto)
    trailer: bytes | None    # the closing trailer, to write after them
    sync: bool               # fsync the file afterwards


class BackupStore:
    def __init__(self, segdir: str = "", *, max_bytes: int = 0, max_memory: int = DEFAULT_MAX_MEMORY,
                 max_replicas: int = limits.MAX_REPLICAS):
        self.segdir = segdir
        self.max_bytes = max_bytes
        self.max_memory = max_memory
        self.max_replicas = max_replicas
        self.replicas: dict[Key, Replica] = {}
        self.dropping: dict[Key, Replica] = {}   # dropped, file not yet unlinked
        self.dirty: dict[Replica, None] = {}     # insertion-ordered set: not yet clean on disk
        self.broker_epochs: dict[int, int] = {}  # lowest epoch accepted per broker
        self.disk_error: str | None = None       # no new replica while set
        self.committed = 0    # bytes the segment files will take (checked against max_bytes)
        self.unflushed = 0    # accepted bytes not yet written
        self.memory = 0       # payload bytes held in memory
        self.floors: dict[tuple[int, int], int] = {}  # (broker, vlog) -> vsegs below were released
        self.reclaimed = 0    # file bytes deleted because their vsegs were released
        self.index_bytes = 0  # closed replicas' indexes kept (``Replica.seal_index``)

    # -- released vsegs ---------------------------------------------------------------------

    def raise_floor(self, broker: int, vlog: int, floor: int) -> bool:
        """The broker released every vseg of ``vlog`` below ``floor``; True if that is news."""
        if floor <= self.floors.get((broker, vlog), 0):
            return False
        self.floors[(broker, vlog)] = floor
        return True

    def below_floor(self, broker: int | None = None, vlog: int | None = None) -> list[Replica]:
        """Replicas of released vsegs: their files are to be deleted."""
        return [r for (b, v, s), r in self.replicas.items()
                if (broker is None or (b == broker and v == vlog)) and s < self.floors.get((b, v), 0)]

    def floor_list(self, broker: int | None = None) -> list[list[int]]:
        return [[b, v, f] for (b, v), f in sorted(self.floors.items()) if broker is None or b == broker]

    def chunk_ranges(self, rep: Replica, ranges) -> list[tuple[int, int]]:
        """Validate ``ranges`` ([[offset, size], ...]): each exactly one good chunk of ``rep``,
        all together at most a read reply (or one chunk)."""
        if not isinstance(ranges, list) or not ranges:
            raise InvalidArgument("read_chunks needs ranges [[offset, size], ...]")
        out, total = [], 0
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int and x >= 0 for x in r)):
                raise InvalidArgument("a range is [offset, size]")
            off, size = r
            i = bisect_left(rep.starts, off)
            if i < len(rep.corrupt_starts) and off in rep.corrupt_starts:
                raise ChecksumError(f"replica {rep.key}: chunk at {off} is corrupt; never served")
            if i >= len(rep.starts) or rep.starts[i] != off or rep.ends[i] != off + size:
                raise InvalidArgument(f"replica {rep.key}: [{off}, {off + size}) is not a chunk")
            out.append((off, size))
            total += size
        if total > limits.MAX_READ and len(out) > 1:
            raise LimitExceeded(f"read_chunks of {total} bytes exceeds MAX_READ", limit="MAX_READ",
                                bound=limits.MAX_READ, size=total)
        return out

    def path_for(self, key: Key) -> str:
        return os.path.join(self.segdir, segment_file.file_name(*key))

    # -- replicate ---------------------------------------------------------------------------

    def accept_replicate(self, key: Key, epoch: int, offset: int, n: int, close: bool) -> Decision:
        """The offset, duplicate, close, fence and state rules for ``n`` bytes at ``offset``.

        Raises the typed error the RPC answers with; changes nothing.
        """
        if n > limits.MAX_REPLICATE_PAYLOAD:
            raise InvalidArgument(f"replicate payload of {n} bytes exceeds {limits.MAX_REPLICATE_PAYLOAD}")
        known = self.broker_epochs.get(key[0], 0)
        if epoch < known:
            raise Fenced(f"broker {key[0]} epoch {epoch} is older than {known}")
        rep = self.replicas.get(key)
        if rep is None:
            if offset != 0:
                raise length_error(f"no replica {key} here, offset {offset}", 0)
            if n == 0 and not close:
                return Decision(EMPTY, key, epoch, None, 0)
            if key in self.dropping:
                raise BackupError(f"replica {key} is being dropped; retry")
            if self.disk_error:
                raise BackupError(f"disk failing, no new segment accepted: {self.disk_error}")
            if len(self.replicas) >= self.max_replicas:
                raise BackupError(f"backup holds {self.max_replicas} replicas already")
            return Decision(NEW, key, epoch, None, n, n, close)
        if rep.error:
            raise BackupError(f"replica {key}: {rep.error}")
        end = offset + n
        kind = APPEND
        if end <= rep.length:
            if not close or rep.closed:
                return Decision(DUPLICATE, key, epoch, rep, end, 0, close)
            if end != rep.length:
                raise length_error(f"close of {key} at {end}", rep.length)
            kind, n = CLOSE, 0  # the bytes are a resend, only the close is new
        elif offset != rep.length:
            raise length_error(f"replica {key}: offset {offset} is not its end", rep.length)
        if rep.damaged:
            raise BackupError(f"replica {key} is damaged on disk; it takes no appends")
        if rep.closed:
            raise BackupError(f"replica {key} is closed; length={rep.length}")
        return Decision(kind, key, epoch, rep, rep.length + n, n, close)

    def need(self, d: Decision) -> int:
        """File bytes the decision adds: its bytes, a new file's header, the trailer."""
        return d.take + (segment_file.FILE_HEADER_SIZE if d.kind == NEW else 0) \
            + (segment_file.TRAILER_SIZE if d.close else 0)

    def check_limits(self, d: Decision) -> None:
        """Replica size, --max-bytes (the disk) and --max-memory (bytes not yet written)."""
        base = d.replica.length if d.replica is not None else 0
        if base + d.take > limits.MAX_REPLICA_BYTES:
            raise BackupError(f"replica {d.key} would exceed {limits.MAX_REPLICA_BYTES} bytes")
        need = self.need(d)
        if self.max_bytes and self.committed + need > self.max_bytes:
            raise BackupError(f"backup full: {self.committed} + {need} bytes exceeds --max-bytes "
                              f"{self.max_bytes}; nothing stored")
        if self.unflushed + d.take > self.max_memory:
            raise BackupError(f"backup memory full ({self.unflushed} bytes not yet on disk); retry")

    def commit(self, d: Decision, payload: memoryview, chunks) -> Replica:
        """Store what ``d`` accepted: its ``d.take`` bytes (verified: ``scan_payload``), the close."""
        assert payload.nbytes == d.take
        self.check_limits(d)
        need = self.need(d)
        # accepted: nothing below raises
        rep = d.replica
        if rep is None:
            rep = d.replica = Replica(*d.key, d.epoch, self.path_for(d.key))
            self.replicas[d.key] = rep
        self.broker_epochs[d.key[0]] = max(self.broker_epochs.get(d.key[0], 0), d.epoch)
        if d.take:
            rep.append(payload, *chunks)
            d.chunks = len(chunks[1])
            self.unflushed += d.take
            self.memory += d.take
        if d.close and not rep.closed:
            rep.closed = True
            self.index_bytes += rep.seal_index(limits.INDEX_CACHE - self.index_bytes)
        self.committed += need
        rep.budget += need
        self.dirty[rep] = None
        d.length = rep.length
        return rep

    def replicate(self, key: Key, epoch: int, offset: int, payload: memoryview, close: bool,
                  scanned=None) -> Decision:
        """Decide, verify the bytes to store, check the limits, store: all or nothing.
        ``scanned``: ``scan_payload(payload)``, when the caller verified it already."""
        d = self.accept_replicate(key, epoch, offset, payload.nbytes, close)
        if d.stores:
            whole = payload.nbytes == d.take
            mv = payload if whole else payload[:d.take]
            if d.take:
                scanned = scanned if whole and scanned is not None else scan_payload(mv)
            self.commit(d, mv, scanned if d.take else None)
        return d

    # -- registry ----------------------------------------------------------------------------

    def load(self, rep: Replica, file_size: int) -> None:
        """A replica reloaded from its file; its broker's epochs below its own are fenced."""
        rep.budget = file_size
        self.committed += file_size
        self.replicas[rep.key] = rep
        self.broker_epochs[rep.broker] = max(self.broker_epochs.get(rep.broker, 0), rep.epoch)

    def forget(self, rep: Replica) -> bool:
        """Take a replica out of service (dropped, or its file could not be made)."""
        if rep.dropped:
            return False
        rep.dropped = True
        if self.replicas.get(rep.key) is rep:
            del self.replicas[rep.key]
        self.dirty.pop(rep, None)
        self.committed -= rep.budget
        self.unflushed -= rep.length - rep.flushed
        self.memory -= rep.memory_bytes
        self.index_bytes -= rep.index.nbytes if rep.index else 0
        rep.blocks, rep.block_starts, rep.heads, rep.index = [], array("Q"), None, None
        return True

    def drop(self, key: Key) -> Replica | None:
        """Forget the replica; a new one under its key is refused until ``dropped`` (file gone)."""
        rep = self.replicas.get(key)
        if rep is None:
            return None
        self.forget(rep)
        self.dropping[key] = rep
        return rep

    def dropped(self, rep: Replica) -> None:
        if self.dropping.get(rep.key) is rep:
            del self.dropping[rep.key]

    def get(self, key: Key) -> Replica:
        rep = self.replicas.get(key)
        if rep is None:
            raise BackupError(f"no replica {key} here")
        return rep

    def apply_fences(self, fences) -> None:
        """Brokers' epochs the coordinator fenced: their replicas are refused from now on."""
        for b, e in (fences or {}).items():
            self.broker_epochs[int(b)] = max(self.broker_epochs.get(int(b), 0), int(e) + 1)

    def holds(self) -> list[list]:
        return [[b, v, s, r.length, r.closed] for (b, v, s), r in sorted(self.replicas.items())]

    def _of(self, broker: int | None) -> list[Replica]:
        """``broker``'s replicas (every one's if None), in (broker, vlog, vseg) order: only
        theirs sorted, not every replica held."""
        return [self.replicas[k] for k in sorted(k for k in self.replicas if broker is None or k[0] == broker)]

    def listing(self, broker: int | None = None) -> list[dict]:
        return [r.info() for r in self._of(broker)]

    def listing_columns(self, broker: int) -> tuple[list[dict], bytes]:
        """``listing(broker)`` with the closed, intact replicas (most of a long history) as
        ``PLAIN_COLUMNS`` u64s each instead of a map: (the others' maps, those rows)."""
        reps = self._of(broker)
        rows = np.array([r.plain_row() for r in reps if r.plain], "<u8").reshape(-1, PLAIN_COLUMNS)
        return [r.info() for r in reps if not r.plain], rows.tobytes()

    # -- flushing ----------------------------------------------------------------------------

    def flush_jobs(self, fsync: bool) -> list[FlushJob]:
        """What a flush round writes: every dirty replica's new bytes and trailer, fsync if asked.

        Replicas whose file is still being created wait; clean ones leave the dirty set.
        """
        jobs = []
        for rep in list(self.dirty):
            if not rep.created:
                continue  # its first replicate is creating the file
            upto = rep.length
            parts = rep.memory_parts(rep.flushed, upto) if rep.flushed < upto else []
            trailer = segment_file.encode_trailer(upto, rep.chunks + len(rep.corrupt)) \
                if rep.closed and not rep.trailer_written else None
            sync = fsync and (rep.synced < upto or (rep.closed and not rep.trailer_synced))
            if not parts and trailer is None and not sync:
                if rep.clean:
                    self.dirty.pop(rep, None)
                continue
            jobs.append(FlushJob(rep, rep.flushed, upto, parts, trailer, sync))
        return jobs

    def sync_due(self) -> list[tuple[Replica, int, bool]]:
        """What a sync round fsyncs (--fsync periodic / write): each dirty replica with bytes or a
        trailer written since its last fsync, with how far its file is written now."""
        return [(rep, rep.flushed, rep.trailer_written) for rep in self.dirty
                if rep.created and (rep.synced < rep.flushed or (rep.trailer_written and not rep.trailer_synced))]

    def sync_done(self, rep: Replica, upto: int, trailer: bool) -> None:
        """The file was fsynced after ``upto`` bytes (and the trailer, if ``trailer``) were written;
        a closed, clean copy leaves memory."""
        rep.synced = max(rep.synced, upto)
        rep.trailer_synced = rep.trailer_synced or trailer
        if rep.clean:
            self.dirty.pop(rep, None)
            if rep.closed:
                self.memory -= rep.release(rep.length)

    def flush_done(self, job: FlushJob) -> None:
        """The job's bytes are in the file (fsynced if it asked); a closed, clean copy leaves memory."""
        rep = job.replica
        rep.flushed = job.upto
        self.unflushed -= job.upto - job.start
        if job.trailer is not None:
            rep.trailer_written = True
        if job.sync:
            rep.synced = job.upto
            rep.trailer_synced = rep.trailer_written
        rep.error = None
        if rep.clean:
            self.dirty.pop(rep, None)
            if rep.closed:
                self.memory -= rep.release(rep.length)

    def flush_failed(self, rep: Replica, msg: str) -> bool:
        """A write failed: reported to the replica's next replicates; True if it is news."""
        new = rep.error != msg
        rep.error = self.disk_error = msg
        return new

    def relieve_memory(self) -> None:
        """Over --max-memory: forget the bytes the files hold (fsynced), read back from there."""
        if self.memory > self.max_memory:
            for rep in self.replicas.values():
                if rep.synced > rep.mem_base:
                    self.memory -= rep.release(rep.synced)

    # -- reads -------------------------------------------------------------------------------

    def plan_read(self, key: Key, offset: int, max_bytes: int):
        """(replica, start, stop, corrupt_at, next, in_memory) of a read at ``offset``."""
        rep = self.get(key)
        start, stop, corrupt_at, nxt = rep.plan_read(offset, max_bytes)
        return rep, start, stop, corrupt_at, nxt, start == stop or start >= rep.mem_base

    @staticmethod
    def chunk_bounds(rep: Replica, start: int, stop: int) -> tuple[list[int], list[int]]:
        """Starts and ends of the chunks making up [start, stop), to verify a file read."""
        i = bisect_left(rep.starts, start)
        j = bisect_left(rep.ends, stop, i)
        assert rep.starts[i] == start and rep.ends[j] == stop
        return rep.starts[i:j + 1].tolist(), rep.ends[i:j + 1].tolist()

    @staticmethod
    def read_meta(rep: Replica, nxt: int, corrupt_at: int | None) -> dict:
        out = {"length": rep.length, "next": nxt, "end": nxt >= rep.length, "closed": rep.closed}
        if corrupt_at is not None:
            out["corrupt_at"] = corrupt_at
        return out
