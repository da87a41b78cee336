"""Index chunks: an adopted segment, described in a chunk its new owner replicates.

A recovery hands a new owner a dead broker's settled segments as *index*
(per chunk: its end, the vseg of the dead incarnation holding it and the
offset there) instead of bodies (``kera.repoint_plan``). The new owner makes
each adoption durable before the streamlet serves by appending one index
chunk per adopted segment to the group's own virtual log, through the normal
replication path. If the new owner dies too, its vlogs hold these chunks
where the segment's data would be: its recovery adopts the segment again
from them (by replay, or from the backups' index of a settled vseg), naming
the original copies, so a chain of failures never chains indirections.

An index chunk is an ordinary chunk (header, one record, checksums) with the
``chunk.INDEX`` flag (and ``chunk.CLOSE`` when the segment is its closed group's
last: nothing follows it in the group); its header places it at (group, segment, 0) of the
segment it describes and names the segment's first producer (the group's
slot). Its one value is little-endian u64s::

    MAGIC, source broker, source vlog, n (chunks), m (vsegs), k (copies)
    n rows: end in the segment, vseg, offset in the vseg, producer, sequence
    m vsegs: vseg id, copies of it
    k backup ids, the copies of each vseg in turn

One format serves the ``adopt`` request, the owner's vlog and the replay.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from operator import ge

import numpy as np

from . import chunk
from .errors import InvalidArgument, ProtocolError
from .limits import MAX_CHUNK

MAGIC = 0x3158444E494B  # "KINDX1"
ROW = 5                 # u64s per chunk row
HEAD = 6
MAX_ROWS = (MAX_CHUNK - chunk.HEADER_SIZE - 4096) // (8 * (ROW + 2))  # rows an index chunk holds


@dataclass(slots=True)
class SegmentIndex:
    """One adopted segment: where each of its chunks lies among a dead incarnation's vsegs."""

    stream: int
    streamlet: int
    group: int
    segment: int
    source: int            # the broker whose vsegs hold the chunks
    vlog: int              # its vlog (the epoch in the high bits)
    rows: np.ndarray       # (n, 5) u64: end, vseg, vseg offset, producer, sequence
    copies: dict[int, list[int]]  # vseg -> backups holding it whole

    @property
    def head(self) -> int:
        return int(self.rows[-1, 0])

    def producers(self) -> dict[int, int]:
        """Each producer's highest sequence in the segment (resends stay duplicates)."""
        return highest_sequences(self.rows)


def highest_sequences(rows: np.ndarray) -> dict[int, int]:
    """Each producer's highest sequence in ``rows`` (of one or many segments' indexes): rows
    sorted by (producer, sequence), the dict keeps each producer's last."""
    p, q = rows[:, 3], rows[:, 4]
    o = np.lexsort((q, p))
    return dict(zip(p[o].tolist(), q[o].tolist(), strict=True))


def build(ix: SegmentIndex, closed: bool = False) -> bytes:
    """The index chunk of ``ix`` (its placement is the segment's start). ``closed``: the
    segment is its group's last and the group is closed (flags ``INDEX | CLOSE``)."""
    n = len(ix.rows)
    if not 0 < n <= MAX_ROWS:
        raise InvalidArgument(f"an index chunk holds 1..{MAX_ROWS} rows, not {n}")
    vsegs = sorted(ix.copies)
    per = [x for v in vsegs for x in (v, len(ix.copies[v]))]
    backups = [b for v in vsegs for b in ix.copies[v]]
    value = b"".join((np.array([MAGIC, ix.source, ix.vlog, n, len(vsegs), len(backups)], "<u8").tobytes(),
                      np.ascontiguousarray(ix.rows, "<u8").tobytes(), np.array(per + backups, "<u8").tobytes()))
    data = bytearray(chunk.build(ix.stream, ix.streamlet, int(ix.rows[0, 3]), 0, [value], timestamps=0,
                                 flags=chunk.INDEX | (chunk.CLOSE if closed else 0)))
    chunk.place(data, 0, ix.group, ix.segment, 0)
    return bytes(data)


def parse(data, h: chunk.ChunkHeader | None = None) -> SegmentIndex:
    """The segment an index chunk (verified by the caller's ``chunk.scan``) describes.

    Parsed once per adopted segment: a few array views and checks, no Python loop per row."""
    h = h or chunk.parse_header(data)
    if not h.flags & chunk.INDEX or h.record_count != 1 or h.offset != 0:
        raise ProtocolError("not an index chunk")
    value = _value(data, h)
    if len(value) < 8 * HEAD or len(value) % 8:
        raise ProtocolError("index chunk too short")
    a = np.frombuffer(value, "<u8")
    magic, source, vlog, n, m, k = a[:HEAD].tolist()
    if magic != MAGIC or n == 0 or len(a) != HEAD + ROW * n + 2 * m + k:
        raise ProtocolError("index chunk is not a segment index")
    rows = a[HEAD:HEAD + ROW * n].reshape(n, ROW)
    per = a[HEAD + ROW * n:HEAD + ROW * n + 2 * m]
    vsegs, counts = per[0::2].tolist(), per[1::2].tolist()
    if sum(counts) != k:
        raise ProtocolError("index chunk copies disagree")
    backups = a[HEAD + ROW * n + 2 * m:].tolist()
    copies, at = {}, 0
    for v, c in zip(vsegs, counts, strict=True):  # per vseg (a few), not per row
        copies[v] = backups[at:at + c]
        at += c
    ends = rows[:, 0].tolist()
    if not set(rows[:, 1].tolist()) <= copies.keys() or any(map(ge, ends, ends[1:])):
        raise ProtocolError("index chunk rows name vsegs it has no copies of, or are out of order")
    return SegmentIndex(h.stream_id, h.streamlet, h.group, h.segment, source, vlog, rows, copies)


_OFFSETS = struct.Struct("<4I")   # a one-record chunk's key and value offsets (``kera.chunk``)


def _value(data, h: chunk.ChunkHeader) -> memoryview:
    """The value of a one-record chunk: its offsets read with one unpack (a ``ChunkView``
    checks any chunk's offsets with numpy, which costs more than the rest of this parse)."""
    k0, k1, v0, v1 = _OFFSETS.unpack_from(data, chunk.HEADER_SIZE + 8)
    start = chunk.HEADER_SIZE + 24 + k1
    if k0 or v0 or 24 + k1 + v1 > h.body_len:
        raise ProtocolError("index chunk offsets are not within its body")
    return memoryview(data)[start:start + v1]
