"""Index chunks: a run of adopted segments, described in a chunk its new owner replicates.

A recovery hands a new owner a dead broker's settled segments as *index*
(per chunk: its end, the vseg of the dead incarnation holding it and the
offset there) instead of bodies (``kera.recovery.repoint_plan``). The new owner makes
each adoption durable before the streamlet serves by appending one index
chunk per run of consecutive adopted segments of a group (not one per
segment: what an adoption costs grows with the groups, not with the history)
to the group's own virtual log, through the normal replication path. If the
new owner dies too, its vlogs hold these chunks
where the segments' data would be: its recovery adopts the segments again
from them (by replay, or from the backups' index of a settled vseg), naming
the original copies, so a chain of failures never chains indirections.

An index chunk is an ordinary chunk (header, one record, checksums) with the
``chunk.INDEX`` flag (and ``chunk.CLOSE`` when its last segment is its closed
group's last: nothing follows it in the group); its header places it at
(group, first segment, 0) of the run it describes and names the first
segment's first producer (the group's slot). Its one value is little-endian
u64s::

    MAGIC3, source broker, source vlog, n (chunks), m (vsegs), k (copies), s (segments)
    s counts: chunks of each segment of the run, in turn
    n rows: end in its segment, vseg, offset in the vseg, producer, sequence,
            Kafka base offset + 1 (0: none), records
    m vsegs: vseg id, copies of it
    k backup ids, the copies of each vseg in turn

The Kafka columns let the new owner index the adopted chunks' partition offsets
(``kera.kafka.log``) without reading them. An index chunk written before them
(``MAGIC2``: five u64s per row) or before runs (``MAGIC``: no ``s`` and no
counts, one segment) is read the same way, its chunks' offsets unknown, so a
vlog holding any of them is replayed and re-pointed as it stands.

One format serves the ``adopt`` request, the owner's vlog and the replay.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .. import chunk
from ..errors import InvalidArgument, ProtocolError
from ..limits import MAX_CHUNK

MAGIC = 0x3158444E494B   # "KINDX1": one segment
MAGIC2 = 0x3258444E494B  # "KINDX2": a run of segments
MAGIC3 = 0x3358444E494B  # "KINDX3": a run of segments, its chunks' Kafka offsets
ROW = 7                  # u64s per chunk row
OLD_ROW = 5              # of KINDX1 and KINDX2: no Kafka columns
KAFKA, RECORDS = 5, 6    # a row's Kafka base offset + 1 (0: none) and records
HEAD = 6                 # u64s before the rows (KINDX1); KINDX2 and 3 add s and the s counts
MAX_ROWS = (MAX_CHUNK - chunk.HEADER_SIZE - 4096) // (8 * (ROW + 3))  # rows an index chunk holds


@dataclass(slots=True)
class SegmentIndex:
    """A run of consecutive adopted segments of one group (from ``segment`` on, ``counts[i]``
    rows each): where each of their chunks lies among a dead incarnation's vsegs."""

    stream: int
    streamlet: int
    group: int
    segment: int           # the run's first segment
    source: int            # the broker whose vsegs hold the chunks
    vlog: int              # its vlog (the epoch in the high bits)
    rows: np.ndarray       # (n, 7) u64: end in its segment, vseg, vseg offset, producer, sequence,
    #                        Kafka base offset + 1 (0: none), records
    copies: dict[int, list[int]]  # vseg -> backups holding it whole
    counts: list[int] | None = None  # rows of each segment of the run; None: one segment

    def __post_init__(self) -> None:
        if self.counts is None:
            self.counts = [len(self.rows)]

    @property
    def starts(self) -> list[int]:
        """Each segment's first row."""
        out, at = [], 0
        for c in self.counts:
            out.append(at)
            at += c
        return out

    @property
    def heads(self) -> list[int]:
        """Each segment's head (its last chunk's end)."""
        ends = self.rows[:, 0]
        return ends[np.cumsum(self.counts) - 1].tolist()

    @property
    def head(self) -> int:
        """The last segment's head."""
        return int(self.rows[-1, 0])

    def producers(self) -> dict[int, int]:
        """Each producer's highest sequence in the run (resends stay duplicates)."""
        return highest_sequences(self.rows)


def highest_sequences(rows: np.ndarray) -> dict[int, int]:
    """Each producer's highest sequence in ``rows`` (of one or many segments' indexes): rows
    sorted by (producer, sequence), the dict keeps each producer's last."""
    p, q = rows[:, 3], rows[:, 4]
    o = np.lexsort((q, p))
    return dict(zip(p[o].tolist(), q[o].tolist(), strict=True))


def build(ix: SegmentIndex, closed: bool = False) -> bytes:
    """The index chunk of ``ix`` (its placement is the run's first segment's start).
    ``closed``: the run's last segment is its group's last and the group is closed (flags
    ``INDEX | CLOSE``)."""
    n = len(ix.rows)
    if not 0 < n <= MAX_ROWS or sum(ix.counts) != n or min(ix.counts) < 1:
        raise InvalidArgument(f"an index chunk holds 1..{MAX_ROWS} rows, at least one per segment, "
                              f"not {n} in {ix.counts}")
    rows = _with_kafka(ix.rows)
    vsegs = sorted(ix.copies)
    per = [x for v in vsegs for x in (v, len(ix.copies[v]))]
    backups = [b for v in vsegs for b in ix.copies[v]]
    value = b"".join((
        np.array([MAGIC3, ix.source, ix.vlog, n, len(vsegs), len(backups), len(ix.counts), *ix.counts],
                 "<u8").tobytes(),
        np.ascontiguousarray(rows, "<u8").tobytes(), np.array(per + backups, "<u8").tobytes()))
    data = bytearray(chunk.build(ix.stream, ix.streamlet, int(ix.rows[0, 3]), 0, [value], timestamps=0,
                                 flags=chunk.INDEX | (chunk.CLOSE if closed else 0)))
    chunk.place(data, 0, ix.group, ix.segment, 0)
    return bytes(data)


def _with_kafka(rows: np.ndarray) -> np.ndarray:
    """Rows of ``ROW`` columns: rows without the Kafka ones (written before them) get zeros,
    their chunks' offsets unknown."""
    if rows.shape[1] == ROW:
        return rows
    return np.concatenate((rows, np.zeros((len(rows), ROW - rows.shape[1]), np.uint64)), axis=1)


def parse(data, h: chunk.ChunkHeader | None = None) -> SegmentIndex:
    """The run an index chunk (verified by the caller's ``chunk.scan``) describes.

    Parsed once per run: a few array views and checks, no Python loop per row."""
    h = h or chunk.parse_header(data)
    if not h.flags & chunk.INDEX or h.record_count != 1 or h.offset != 0:
        raise ProtocolError("not an index chunk")
    value = _value(data, h)
    if len(value) < 8 * HEAD or len(value) % 8:
        raise ProtocolError("index chunk too short")
    a = np.frombuffer(value, "<u8")
    magic, source, vlog, n, m, k = a[:HEAD].tolist()
    at = HEAD
    if magic in (MAGIC2, MAGIC3) and len(a) > HEAD:
        s = int(a[HEAD])
        at = HEAD + 1 + s
        counts = a[HEAD + 1:at].tolist() if s <= len(a) else []
        if not 0 < s == len(counts) or min(counts) < 1 or sum(counts) != n:
            raise ProtocolError("index chunk segment counts disagree")
    elif magic == MAGIC:
        counts = [n]
    else:
        raise ProtocolError("index chunk is not a segment index")
    w = ROW if magic == MAGIC3 else OLD_ROW
    if n == 0 or len(a) != at + w * n + 2 * m + k:
        raise ProtocolError("index chunk is not a segment index")
    rows = a[at:at + w * n].reshape(n, w)
    rows = _with_kafka(rows)
    per = a[at + w * n:at + w * n + 2 * m]
    vsegs, cs = per[0::2].tolist(), per[1::2].tolist()
    if sum(cs) != k:
        raise ProtocolError("index chunk copies disagree")
    backups = a[at + w * n + 2 * m:].tolist()
    copies, b = {}, 0
    for v, c in zip(vsegs, cs, strict=True):  # per vseg (a few), not per row
        copies[v] = backups[b:b + c]
        b += c
    ends = rows[:, 0]
    rising = ends[1:] > ends[:-1]
    if len(counts) > 1:  # a segment's first end starts anew
        rising[np.cumsum(counts[:-1], dtype=np.int64) - 1] = True
    if not set(rows[:, 1].tolist()) <= copies.keys() or not rising.all():
        raise ProtocolError("index chunk rows name vsegs it has no copies of, or are out of order")
    return SegmentIndex(h.stream_id, h.streamlet, h.group, h.segment, source, vlog, rows, copies, counts)


_OFFSETS = struct.Struct("<4I")   # a one-record chunk's key and value offsets (``kera.chunk``)


def _value(data, h: chunk.ChunkHeader) -> memoryview:
    """The value of a one-record chunk: its offsets read with one unpack (a ``ChunkView``
    checks any chunk's offsets with numpy, which costs more than the rest of this parse)."""
    k0, k1, v0, v1 = _OFFSETS.unpack_from(data, chunk.HEADER_SIZE + 8)
    start = chunk.HEADER_SIZE + 24 + k1
    if k0 or v0 or 24 + k1 + v1 > h.body_len:
        raise ProtocolError("index chunk offsets are not within its body")
    return memoryview(data)[start:start + v1]
