"""The chunk's bytes: its layout, its header, and the checks of one chunk or many at once.

Layout (little endian), 8-byte aligned so numpy views work in place:

    header (88 bytes, see HEADER)
    timestamps  int64[n]       milliseconds since the epoch
    key_offsets uint32[n + 1]  into the key bytes (a record without key has an empty key)
    val_offsets uint32[n + 1]  into the value bytes
    keys, values, zero padding to a multiple of 8

The offsets arrays have Arrow's binary layout, so a chunk becomes an Arrow
batch without copying. ``body_checksum`` is xxh3-64 of the body; the header
checksum (xxh32 of the header bytes before it) also covers the
[group, segment, offset] placement the broker writes at append time.

``reserved`` holds the chunk's Kafka base offset plus one, written by the broker with its
placement (``place``'s ``kafka_base``, or ``set_kafka_offset``; 0: none yet), so the dense
offsets of a partition are replayed with its chunks (``kera.kafka.log``).

``flags`` (one byte): ``SEQ_RESET`` marks the first chunk a producer sends
after giving up on earlier ones of the streamlet; the broker takes its
sequence as the producer's new base (see ``sequences.verdict``);
``INDEX`` marks an index chunk, which lives only in a virtual log
(``kera.recovery.index_chunk``); ``COMPACTED`` marks a chunk rewritten by key
compaction (``kera.chunk.view.rewrite``): it keeps the placement of the chunk it
came from, and after its values a uint32 array of each surviving record's index in
the original chunk, so a committed skip count ("the first k records of the chunk at
this position were consumed") keeps its meaning (``skip_in`` / ``skip_out``);
``CLOSE`` marks a group's last chunk; ``KAFKA`` marks a chunk whose body is a Kafka
record batch, padded to 8 bytes (``kera.kafka.convert``): a ``ChunkView`` reads its
records through a conversion to this layout.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import namedtuple

import numpy as np
import xxhash

from ..errors import ChecksumError, ProtocolError
from ..limits import MAX_RECORDS

MAGIC = b"KC"
VERSION = 1
HEADER = struct.Struct("<2sBBQIIQQqqIIIIQQI")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 88
_CHECKED = HEADER_SIZE - 4  # the header checksum covers everything before it
_PLACEMENT = struct.Struct("<III")
_PLACEMENT_AT = 52
_FLAGS_AT = 3
_HCHECK = struct.Struct("<I")
assert sys.byteorder == "little" and array("I").itemsize == 4, "chunks are little endian"
NO_PLACEMENT = 0xFFFFFFFF
# the header as a numpy record: many headers are read or built as arrays (one pass per request)
HEADER_DTYPE = np.dtype([
    ("magic", "S2"), ("version", "u1"), ("flags", "u1"), ("stream_id", "<u8"), ("streamlet", "<u4"),
    ("record_count", "<u4"), ("producer_id", "<u8"), ("sequence", "<u8"), ("ts_min", "<i8"),
    ("ts_max", "<i8"), ("group", "<u4"), ("segment", "<u4"), ("offset", "<u4"), ("body_len", "<u4"),
    ("body_checksum", "<u8"), ("reserved", "<u8"), ("header_checksum", "<u4")])
assert HEADER_DTYPE.itemsize == 88
SEQ_RESET = 0x01  # flags: this chunk's sequence is its producer's new base on the streamlet
INDEX = 0x02      # flags: an adopted segment's index, not records (``kera.recovery.index_chunk``)
COMPACTED = 0x04  # flags: rewritten by compaction; original record indices follow the values
CLOSE = 0x08  # flags: a group closed: no chunk follows in it
KAFKA = 0x10  # flags: the body is a Kafka record batch (magic 2) as its producer sent it
_RESERVED = struct.Struct("<Q")
_RESERVED_AT = 76   # the header's ``reserved``: a partition's Kafka base offset + 1 (0: none)


_Fields = namedtuple("_Fields", "flags stream_id streamlet record_count producer_id sequence ts_min "
                               "ts_max group segment offset body_len body_checksum")


class ChunkHeader(_Fields):
    """A decoded header: a tuple (built in C from struct fields, cheap per chunk)."""

    __slots__ = ()

    @property
    def size(self) -> int:
        return HEADER_SIZE + self.body_len


_make = ChunkHeader._make


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def chunk_size(records: int, data_bytes: int) -> int:
    """Bytes of a chunk of ``records`` records with ``data_bytes`` of keys and values."""
    return HEADER_SIZE + _pad8(16 * records + 8 + data_bytes)


def record_room(max_chunk: int) -> int:
    """The most ``16 * records + key and value bytes`` a chunk of ``max_chunk`` bytes holds."""
    return ((max_chunk - HEADER_SIZE) & ~7) - 8


def seal(stream_id, streamlet, producer_id, sequence, n, ts_min, ts_max, body,
                 flags: int = 0) -> bytes:
    """The chunk: its header, then ``body`` (bytes, or a list of buffers: hashed piece by piece
    and copied once, straight into the chunk)."""
    if isinstance(body, list):
        h = xxhash.xxh3_64()
        for part in body:
            h.update(part)
        body_len, digest = sum(memoryview(part).nbytes for part in body), h.intdigest()
    else:
        body_len, digest, body = len(body), xxhash.xxh3_64_intdigest(body), [body]
    head = bytearray(HEADER.pack(MAGIC, VERSION, flags, stream_id, streamlet, n, producer_id, sequence,
                                 ts_min, ts_max, NO_PLACEMENT, NO_PLACEMENT, NO_PLACEMENT, body_len,
                                 digest, 0, 0))
    _HCHECK.pack_into(head, _CHECKED, xxhash.xxh32_intdigest(memoryview(head)[:_CHECKED]))
    return b"".join((head, *body))


def with_flags(data, flags: int) -> bytes:
    """A copy of the chunk in ``data`` with its header flags set to ``flags`` (checksum resealed)."""
    head = bytearray(data[:HEADER_SIZE])
    head[_FLAGS_AT] = flags
    _HCHECK.pack_into(head, _CHECKED, xxhash.xxh32_intdigest(memoryview(head)[:_CHECKED]))
    return b"".join((head, memoryview(data)[HEADER_SIZE:]))


def parse_header(buf, offset: int = 0) -> ChunkHeader:
    """Validate and decode a header (not the body). Raises on any damage."""
    if len(buf) - offset < HEADER_SIZE:
        raise ProtocolError("truncated chunk header")
    f = HEADER.unpack_from(buf, offset)
    if f[0] != MAGIC or f[1] != VERSION:
        raise ProtocolError("not a chunk header")
    if xxhash.xxh32_intdigest(memoryview(buf)[offset:offset + _CHECKED]) != f[16]:
        raise ChecksumError("chunk header checksum mismatch")
    h = _make(f[2:15])
    if h.record_count == 0 or h.record_count > MAX_RECORDS or h.body_len % 8 \
            or (h.body_len < 16 * h.record_count + 8 and not h.flags & KAFKA):
        raise ProtocolError("inconsistent chunk header")
    return h


def verify(buf, offset: int = 0) -> ChunkHeader:
    """Check header and body checksums of the chunk at ``offset``."""
    h = parse_header(buf, offset)
    end = offset + HEADER_SIZE + h.body_len
    if end > len(buf):
        raise ProtocolError("truncated chunk body")
    if xxhash.xxh3_64_intdigest(memoryview(buf)[offset + HEADER_SIZE:end]) != h.body_checksum:
        raise ChecksumError("chunk body checksum mismatch")
    return h


def scan(buf, verify_bodies: bool = True) -> list[tuple[ChunkHeader, int]]:
    """Headers and offsets of the back-to-back chunks filling ``buf`` exactly."""
    out = []
    pos, n = 0, len(buf)
    check = verify if verify_bodies else parse_header
    while pos < n:
        h = check(buf, pos)
        if pos + h.size > n:
            raise ProtocolError("truncated chunk body")
        out.append((h, pos))
        pos += h.size
    return out


_BODY_LEN = struct.Struct("<I")
_BODY_LEN_AT = 64


FEW = 4  # chunks up to which checking each with ``verify`` costs less than numpy's fixed cost


def scan_headers(buf) -> tuple[np.ndarray, list[int]]:
    """``scan`` in one pass: every chunk filling ``buf`` exactly, checked as ``verify`` checks
    one, its header as a ``HEADER_DTYPE`` record and its offset.

    The walk reads each chunk's length, the header checks are ``headers_ok``, the body
    checksums one call per chunk; up to ``FEW`` chunks (a request at low load) are checked
    by ``verify`` instead. On any damage ``scan`` runs again over ``buf`` to raise the typed
    error of the first bad chunk.
    """
    n = len(buf)
    if n == 0:
        return np.zeros(0, HEADER_DTYPE), []
    offs = []
    pos = 0
    unpack = _BODY_LEN.unpack_from
    while pos + HEADER_SIZE <= n:
        offs.append(pos)
        pos += HEADER_SIZE + unpack(buf, pos + _BODY_LEN_AT)[0]
    mv = memoryview(buf)
    if pos == n and offs:
        hb = b"".join([mv[o:o + HEADER_SIZE] for o in offs])
        if len(offs) <= FEW:
            for o in offs:
                verify(mv, o)
            return np.frombuffer(hb, HEADER_DTYPE), offs
        h = np.frombuffer(hb, HEADER_DTYPE)
        b3 = xxhash.xxh3_64_intdigest
        if headers_ok(h, hb).all() \
                and (np.fromiter(map(b3, (mv[o + HEADER_SIZE:o + HEADER_SIZE + z]
                                          for o, z in zip(offs, h["body_len"].tolist(), strict=True))),
                                 np.uint64, len(offs)) == h["body_checksum"]).all():
            return h, offs
    scan(buf)  # raises the first chunk's error
    raise ProtocolError("damaged chunks")  # not reached: what fails above fails there


def headers_ok(h: np.ndarray, hb) -> np.ndarray:
    """Per header of ``h`` (``HEADER_DTYPE`` records, packed back to back in ``hb``): does it
    pass ``parse_header``'s checks? Array comparisons and one xxh32 call per header; the
    caller runs ``parse_header`` on a failed one for its typed error."""
    rc, bl = h["record_count"], h["body_len"]
    x32 = xxhash.xxh32_intdigest
    mv = memoryview(hb)
    sums = np.fromiter(map(x32, (mv[i:i + _CHECKED] for i in range(0, len(h) * HEADER_SIZE, HEADER_SIZE))),
                       np.uint32, len(h))
    return ((h["magic"] == MAGIC) & (h["version"] == VERSION) & (sums == h["header_checksum"])
            & (rc > 0) & (rc <= MAX_RECORDS) & (bl % 8 == 0)
            & ((bl >= 16 * rc.astype(np.int64) + 8) | (h["flags"] & KAFKA != 0)))


def set_kafka_offset(buf, offset: int, base: int) -> None:
    """Write a chunk's Kafka base offset into its header (sealed by a ``place`` that follows)."""
    _RESERVED.pack_into(buf, offset + _RESERVED_AT, base + 1)


def kafka_offset(buf, offset: int = 0) -> int | None:
    """The Kafka base offset written in the chunk at ``offset``, None if none was."""
    v = _RESERVED.unpack_from(buf, offset + _RESERVED_AT)[0]
    return v - 1 if v else None


def place(buf, offset: int, group: int, segment: int, seg_offset: int,
          kafka_base: int | None = None) -> None:
    """Write the broker-assigned placement (and the chunk's Kafka base offset) into a chunk
    held in ``buf`` (O(1)), and seal its header checksum again."""
    _PLACEMENT.pack_into(buf, offset + _PLACEMENT_AT, group, segment, seg_offset)
    if kafka_base is not None:
        _RESERVED.pack_into(buf, offset + _RESERVED_AT, kafka_base + 1)
    mv = memoryview(buf)
    _HCHECK.pack_into(buf, offset + _CHECKED, xxhash.xxh32_intdigest(mv[offset:offset + _CHECKED]))


