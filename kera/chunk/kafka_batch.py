"""Kafka's RecordBatch (magic 2): its fixed header read and checked, its base offset written.

A Kafka producer's batch is stored as it arrived, as one kera chunk (``kera.kafka.convert``
wraps it): the broker reads only the 61-byte header (offsets, counts, producer id, epoch
and sequence, timestamps, compression), checks the CRC-32C (which covers everything from
the attributes on) and writes the partition's dense base offset into the first field,
which the CRC does not cover. Records are never parsed here.

Layout (big endian)::

    base_offset i64, batch_length i32, leader_epoch i32, magic i8, crc u32, attributes i16,
    last_offset_delta i32, base_timestamp i64, max_timestamp i64, producer_id i64,
    producer_epoch i16, base_sequence i32, records_count i32, records...
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import crc32c

from ..errors import InvalidArgument

HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 61
LOG_OVERHEAD = 12          # base offset and batch length: what batch_length does not count
CRC_FROM = 21              # the CRC covers the batch from its attributes on
_BASE = struct.Struct(">q")
_LENGTH = struct.Struct(">i")
MAGIC = 2

# attributes
COMPRESSION = 0x07         # none, gzip, snappy, lz4, zstd
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
LOG_APPEND_TIME = 0x08
TRANSACTIONAL = 0x10
CONTROL = 0x20
NO_PRODUCER = -1


class CorruptRecord(InvalidArgument):
    """A batch that is not a well-formed RecordBatch v2 (Kafka's CORRUPT_MESSAGE)."""


class Batch(NamedTuple):
    """One batch's header, and where it lies in the buffer it was read from."""

    start: int
    size: int                  # LOG_OVERHEAD + batch_length
    base_offset: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    count: int

    @property
    def codec(self) -> int:
        return self.attributes & COMPRESSION

    @property
    def last_sequence(self) -> int:
        """The sequence of its last record (Kafka's sequences wrap at 2**31)."""
        return (self.base_sequence + self.last_offset_delta) % (1 << 31)


def read(buf, start: int = 0, check_crc: bool = True) -> Batch:
    """The batch at ``start`` of ``buf``, checked: magic 2, a length within ``buf``, at least
    one record, a record count that agrees with the offset deltas, the CRC."""
    if len(buf) - start < HEADER_SIZE:
        raise CorruptRecord(f"a record batch needs {HEADER_SIZE} bytes of header, "
                            f"{len(buf) - start} left")
    f = HEADER.unpack_from(buf, start)
    size = LOG_OVERHEAD + f[1]
    if f[3] != MAGIC:
        raise CorruptRecord(f"record batch magic {f[3]}: only magic 2 (Kafka 0.11 on) is taken")
    if size < HEADER_SIZE or start + size > len(buf):
        raise CorruptRecord(f"record batch length {f[1]} does not fit the {len(buf) - start} bytes sent")
    b = Batch(start, size, f[0], *f[2:])
    if b.count < 1 or b.last_offset_delta != b.count - 1:
        raise CorruptRecord(f"record batch of {b.count} records with last offset delta "
                            f"{b.last_offset_delta}")
    if b.codec >= len(CODECS):
        raise CorruptRecord(f"record batch compression {b.codec} is unknown")
    if check_crc and crc32c.crc32c(memoryview(buf)[start + CRC_FROM:start + size]) != b.crc:
        raise CorruptRecord("record batch CRC-32C mismatch")
    return b


def read_all(buf) -> list[Batch]:
    """Every batch of a produce request's records (back to back, filling ``buf`` exactly)."""
    out, at, n = [], 0, len(buf)
    while at < n:
        b = read(buf, at)
        out.append(b)
        at += b.size
    if not out:
        raise CorruptRecord("a produce request's partition carries no record batch")
    return out


def set_base_offset(buf, start: int, base: int) -> None:
    """Write the partition's base offset into the batch at ``start`` (not covered by the CRC)."""
    _BASE.pack_into(buf, start, base)


def base_offset(buf, start: int = 0) -> int:
    return _BASE.unpack_from(buf, start)[0]


def length(buf, start: int = 0) -> int:
    """The whole batch's bytes, from its length field."""
    return LOG_OVERHEAD + _LENGTH.unpack_from(buf, start + 8)[0]


def seal(head: bytearray | memoryview) -> None:
    """Compute and write the CRC of a batch built in ``head`` (the whole batch)."""
    struct.pack_into(">I", head, 17, crc32c.crc32c(memoryview(head)[CRC_FROM:]))
