"""Replica: a backup's copy of one virtual segment, in memory and on file.

Sans-IO bookkeeping only; ``store`` decides, the service does the I/O. The bytes are the
replicate payloads themselves, kept as the (immutable, bytes-backed)
memoryviews the frame decoder produced: appending is a list append, not a
copy, and a flush hands the same views to one ``pwritev``.

Offsets are chunk-area offsets, as the broker counts them::

    0 ........ mem_base ........ flushed ........ length
    |  file only  |   file + memory  |  memory only  |

``synced <= flushed``: bytes fsynced. A read below ``mem_base`` comes from the
file (and is verified again); at or above, from memory (verified on arrival).
Chunks are indexed by start/end offset (O(1) work per chunk on append) so
reads cut on chunk boundaries without parsing; corrupt regions found on load
or on a file read are indexed apart and never served.

A recovery re-pointing a dead broker's history asks each closed vseg for its
chunks' header rows (``index_rows``, backup ``index``). The headers verified
on arrival are kept (a reference per append, no copy) while the replica is open
and turned into those rows once, when it closes (``seal_index``: the rows, the
rows of its runs of chunks, where its index chunks lie), so the ``index``
answer is a copy of them, however old the vseg: no file read, no check again,
no array work per vseg asked. The store bounds the rows kept (``INDEX_CACHE``); a replica
without them (over the bound, or reloaded from its file) is indexed from its
file's headers, checked then.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

import numpy as np
import xxhash

from ..chunk import FEW, HEADER_DTYPE, HEADER_SIZE, INDEX
from ..errors import InvalidArgument
from ..wire import columns
from .segment_file import FILE_HEADER_SIZE, TRAILER_SIZE, Loaded


def index_rows(starts: np.ndarray, ends: np.ndarray, h: np.ndarray) -> bytes:
    """A vseg's index: per chunk a row of ``INDEX_COLUMNS`` little-endian u64s (vseg offset,
    size, stream, streamlet, group, segment, segment offset, producer, sequence, flags, Kafka
    base offset + 1 (0: none), records: ``kera.wire.columns``) from its verified headers: what
    a new owner adopting the chunks needs, their partition offsets included."""
    return np.column_stack((starts, ends - starts, h["stream_id"], h["streamlet"], h["group"],
                            h["segment"], h["offset"], h["producer_id"], h["sequence"],
                            h["flags"], h["reserved"], h["record_count"])).astype("<u8").tobytes()




def index_runs(rows: np.ndarray) -> np.ndarray:
    """A vseg's index ((n, 12) u64 rows, ``index_rows``) as runs: consecutive chunks of one
    producer in one segment, each following the one before in the segment, in the vseg and
    in its partition's Kafka offsets, plain (no flag: index and close chunks stay rows of
    their own), are one row spanning them (first offsets, the sizes and record counts
    summed, the highest sequence) followed by their count. What a recovery plans the
    settled history from: a row per run, not per chunk."""
    n = len(rows)
    out = np.empty((n, columns.RUN_COLUMNS), np.uint64)
    if not n:
        return out
    c = columns
    voff, size, offset = rows[:, c.IX_VOFF], rows[:, c.IX_SIZE], rows[:, c.IX_OFFSET]
    seq, flags = rows[:, c.IX_SEQUENCE], rows[:, c.IX_FLAGS]
    kafka, records = rows[:, c.IX_KAFKA], rows[:, c.IX_RECORDS]
    joins = (flags[1:] == 0) & (flags[:-1] == 0) & (voff[1:] == voff[:-1] + size[:-1]) \
        & (offset[1:] == offset[:-1] + size[:-1]) \
        & (kafka[1:] == np.where(kafka[:-1] > 0, kafka[:-1] + records[:-1], 0))
    for k in (c.IX_STREAM, c.IX_STREAMLET, c.IX_GROUP, c.IX_SEGMENT, c.IX_PRODUCER):
        joins &= rows[1:, k] == rows[:-1, k]
    first = np.flatnonzero(np.append(True, ~joins))
    out = out[:len(first)]
    out[:, :c.INDEX_COLUMNS] = rows[first]
    out[:, c.IX_SIZE] = np.add.reduceat(size, first)
    out[:, c.IX_SEQUENCE] = np.maximum.reduceat(seq, first)
    out[:, c.IX_RECORDS] = np.add.reduceat(records, first)
    out[:, c.IX_COUNT] = np.diff(np.append(first, n))
    return out


@dataclass(frozen=True, slots=True)
class VsegIndex:
    """A closed replica's index in the two forms a recovery asks for (chunks' rows, runs'
    rows) and where its index chunks lie: made once, so that indexing a vseg of the settled
    history costs no array work per vseg, however many a recovery asks for."""

    rows: bytes                          # ``index_rows``
    runs: bytes | None                   # ``index_runs`` of them (None: not made)
    marks: tuple[tuple[int, int], ...]   # (vseg offset, size) of its index chunks

    @classmethod
    def of(cls, rows: bytes, runs: bool = True) -> VsegIndex:
        """From its rows; ``runs``: make the rows of runs too (a replica indexed from its file
        makes only the form asked for)."""
        a = np.frombuffer(rows, "<u8").reshape(-1, columns.INDEX_COLUMNS)
        marks = np.flatnonzero(a[:, columns.IX_FLAGS] & INDEX)
        return cls(rows, index_runs(a).astype("<u8", copy=False).tobytes() if runs else None,
                   tuple(map(tuple, a[marks, columns.IX_VOFF:columns.IX_SIZE + 1].tolist())))

    @property
    def nbytes(self) -> int:
        return len(self.rows) + len(self.runs or b"") + 16 * len(self.marks)


class Replica:
    __slots__ = ("broker", "vlog", "vseg", "epoch", "path", "length", "starts", "ends", "corrupt",
                 "corrupt_starts", "digest", "blocks", "block_starts", "mem_base", "flushed", "synced",
                 "closed", "trailer_written", "trailer_synced", "damaged", "created", "error",
                 "failed", "dropped", "ready", "budget", "heads", "index")

    def __init__(self, broker: int, vlog: int, vseg: int, epoch: int, path: str):
        self.broker, self.vlog, self.vseg, self.epoch, self.path = broker, vlog, vseg, epoch, path
        self.length = 0
        self.starts = array("Q")          # good chunks: start offsets, ascending
        self.ends = array("Q")            # ... and their end offsets
        self.corrupt: list[dict] = []     # {"offset", "length", "reason"}, ascending, never served
        self.corrupt_starts: list[int] = []
        self.digest = xxhash.xxh3_64()    # over body checksums, like VirtualSegment.checksum
        self.blocks: list[memoryview] = []
        self.block_starts = array("Q")
        self.mem_base = 0
        self.flushed = 0
        self.synced = 0
        self.closed = False
        self.trailer_written = False
        self.trailer_synced = False
        self.damaged = False   # a corrupt region of unknown extent ends the area: no appends
        self.created = False   # the file exists
        self.error: str | None = None   # last write failure; reported until the bytes are on disk
        self.failed: str | None = None  # the file could not be created: this replica is gone
        self.dropped = False
        self.ready = None      # service: trio.Event set once the file exists (or failed)
        self.budget = 0        # store: bytes of its file counted against --max-bytes
        self.heads: list | None = []   # verified headers of the chunks appended (None: not kept)
        self.index: VsegIndex | None = None  # once closed: its index, if kept

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.broker, self.vlog, self.vseg)

    @classmethod
    def from_loaded(cls, ld: Loaded, key: tuple[int, int, int]) -> Replica:
        """A replica reloaded from its file: everything is on disk, nothing in memory."""
        h = ld.header
        rep = cls(*key, h.epoch if h else 0, ld.path)
        rep.created = True
        rep.heads = None
        if ld.scan is None:  # damaged file header: nothing can be trusted or appended
            rep.damaged = rep.closed = rep.trailer_written = rep.trailer_synced = True
            rep.corrupt = [{"offset": 0, "length": ld.file_size, "reason": ld.error}]
            rep.corrupt_starts = [0]
            return rep
        s = ld.scan
        rep.length = rep.mem_base = rep.flushed = rep.synced = s.length
        rep.starts, rep.ends, rep.digest = s.starts, s.ends, s.digest
        rep.corrupt = list(s.corrupt)
        rep.corrupt_starts = [c["offset"] for c in rep.corrupt]
        rep.damaged = s.damaged
        rep.closed = rep.trailer_written = rep.trailer_synced = s.closed
        return rep

    # -- appends -----------------------------------------------------------

    def append(self, payload: memoryview, heads, offs) -> None:
        """Append verified whole chunks: ``kera.chunk.scan_headers(payload)`` (array work only)."""
        assert not self.closed and not self.damaged
        if self.heads is not None:
            self.heads.append(heads)
        base = self.length
        if len(offs) <= FEW:  # a few chunks: list work costs less than numpy's fixed cost
            starts = [base + o for o in offs]
            self.starts.extend(starts)
            self.ends.extend([s + HEADER_SIZE + b for s, b in zip(starts, heads["body_len"].tolist(),
                                                                  strict=True)])
        else:
            starts = np.asarray(offs, np.uint64) + np.uint64(base)
            self.starts.frombytes(starts.tobytes())
            self.ends.frombytes((starts + heads["body_len"] + np.uint64(HEADER_SIZE)).astype("<u8").tobytes())
        self.digest.update(heads["body_checksum"].astype("<u8").tobytes())
        self.blocks.append(payload)
        self.block_starts.append(base)
        self.length = base + payload.nbytes

    def seal_index(self, room: int) -> int:
        """Closed: its index, built once from the headers kept, if it takes at most ``room``
        bytes; returns the bytes kept."""
        heads, self.heads = self.heads, None
        n = len(self.starts)
        if heads is None or n * 8 * (columns.INDEX_COLUMNS + columns.RUN_COLUMNS) > room \
                or sum(map(len, heads)) != n:
            return 0
        starts = np.frombuffer(self.starts, np.uint64)
        h = np.frombuffer(b"".join(x.tobytes() for x in heads), HEADER_DTYPE)  # np.concatenate of
        # a structured dtype costs ten times more
        self.index = VsegIndex.of(index_rows(starts, np.frombuffer(self.ends, np.uint64), h))
        return self.index.nbytes

    @property
    def chunks(self) -> int:
        return len(self.starts)

    @property
    def memory_bytes(self) -> int:
        return self.length - self.mem_base

    @property
    def file_bytes(self) -> int:
        """What this replica's file will take once everything is written."""
        return FILE_HEADER_SIZE + self.length + (TRAILER_SIZE if self.closed else 0)

    @property
    def clean(self) -> bool:
        """Everything is written and fsynced (the trailer too, if closed)."""
        return self.synced == self.length and (not self.closed or self.trailer_synced)

    def memory_parts(self, start: int, stop: int) -> list[memoryview]:
        """Views of [start, stop) from memory; one per block touched, no copy."""
        assert self.mem_base <= start <= stop <= self.length
        parts = []
        i = bisect_right(self.block_starts, start) - 1
        pos = start
        while pos < stop:
            bs, b = self.block_starts[i], self.blocks[i]
            hi = min(b.nbytes, stop - bs)
            parts.append(b[pos - bs:hi])
            pos = bs + hi
            i += 1
        return parts

    def release(self, upto: int) -> int:
        """Forget in-memory blocks that end at or before ``upto`` (already on disk)."""
        assert upto <= self.synced
        k, freed = 0, 0
        while k < len(self.blocks) and self.block_starts[k] + self.blocks[k].nbytes <= upto:
            freed += self.blocks[k].nbytes
            k += 1
        if k:
            del self.blocks[:k]
            del self.block_starts[:k]
            self.mem_base = self.block_starts[0] if self.blocks else self.length
        return freed

    # -- reads -------------------------------------------------------------

    def plan_read(self, offset: int, max_bytes: int) -> tuple[int, int, int | None, int]:
        """Which bytes a read at ``offset`` returns: (start, stop, corrupt_at, next).

        [start, stop) is whole good chunks, at most ``max_bytes`` unless the
        first chunk alone is larger, all in memory or all in the file. When it
        stops before a corrupt region, ``corrupt_at`` is that region's offset
        and ``next`` skips past it.
        """
        if offset < 0 or offset > self.length:
            raise InvalidArgument(f"offset {offset} outside replica of length {self.length}")
        ci = bisect_left(self.corrupt_starts, offset)
        if ci < len(self.corrupt) and self.corrupt_starts[ci] == offset:
            return offset, offset, offset, offset + self.corrupt[ci]["length"]
        if offset == self.length:
            return offset, offset, None, offset
        i = bisect_left(self.starts, offset)
        if i == len(self.starts) or self.starts[i] != offset:
            raise InvalidArgument(f"offset {offset} is not a chunk boundary")
        stop = self.corrupt_starts[ci] if ci < len(self.corrupt) else self.length
        hi = min(stop, self.mem_base) if offset < self.mem_base else stop
        j = max(i, bisect_right(self.ends, min(hi, offset + max_bytes)) - 1)
        end = self.ends[j]
        assert end <= hi
        if ci < len(self.corrupt) and end == stop:
            return offset, end, stop, stop + self.corrupt[ci]["length"]
        return offset, end, None, end

    def mark_corrupt(self, offset: int, size: int, reason: str) -> bool:
        """A chunk failed verification when read back from the file: never serve it.
        False if it was marked already."""
        i = bisect_left(self.starts, offset)
        if i < len(self.starts) and self.starts[i] == offset:
            del self.starts[i]
            del self.ends[i]
            k = bisect_left(self.corrupt_starts, offset)
            self.corrupt_starts.insert(k, offset)
            insort(self.corrupt, {"offset": offset, "length": size, "reason": reason},
                   key=lambda c: c["offset"])
            return True
        return False

    @property
    def plain(self) -> bool:
        """Closed and intact: listed as a row of ``kera.wire.columns.PLAIN_COLUMNS``."""
        return self.closed and not self.corrupt and not self.error

    def plain_row(self) -> tuple[int, int, int, int, int]:
        return self.vlog, self.vseg, self.length, self.chunks, self.digest.intdigest()

    def info(self) -> dict:
        out = {"broker": self.broker, "vlog": self.vlog, "vseg": self.vseg, "length": self.length,
               "chunks": self.chunks, "closed": self.closed, "corrupt": list(self.corrupt),
               "epoch": self.epoch, "synced": self.synced, "checksum": self.digest.intdigest()}
        if self.error:
            out["error"] = self.error
        return out
