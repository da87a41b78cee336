"""A ``KAFKA`` chunk's records in kera's layout (what ``ChunkView`` reads, for kera's
consumer, the Spark source and the key-value map): the batch is decompressed (gzip, snappy,
lz4, zstd), then record starts are found by pointer doubling (each record's length is a
varint at its start: the chain from the first record is followed log2(n) array gathers at a
time, not record by record) and every field is read for all records at once. Kafka's record
headers have no place in a kera chunk: they are dropped (keys, values and timestamps
round-trip exactly). The other way, kera chunks as batches, is ``kera.kafka.convert``'s.
"""

from __future__ import annotations

import struct
import zlib

import cramjam
import numpy as np

from . import kafka_batch as batch
from .builders import build_arrays
from .layout import HEADER_SIZE, KAFKA, kafka_offset, parse_header, place, set_kafka_offset

_XERIAL = b"\x82SNAPPY\x00"
_U64 = np.uint64


def _batch(view) -> memoryview:
    """The record batch a ``KAFKA`` chunk holds (no copy)."""
    return memoryview(view)[HEADER_SIZE:HEADER_SIZE + batch.length(view, HEADER_SIZE)]


def decompress(codec: int, data) -> bytes:
    """The records section of a batch compressed with ``codec`` (``batch.CODECS``)."""
    if codec == 0:
        return bytes(data)
    try:
        if codec == 1:
            return zlib.decompress(bytes(data), 16 + zlib.MAX_WBITS)
        if codec == 2:
            return _unsnappy(bytes(data))
        if codec == 3:
            return bytes(cramjam.lz4.decompress(bytes(data)))
        if codec == 4:
            return bytes(cramjam.zstd.decompress(bytes(data)))
    except Exception as e:  # noqa: BLE001 (each codec raises its own types)
        raise batch.CorruptRecord(f"{batch.CODECS[codec]} records do not decompress: {e}") from None
    raise batch.CorruptRecord(f"compression {codec} is unknown")


def _unsnappy(data: bytes) -> bytes:
    """Snappy as Kafka's clients write it: xerial's framing (blocks of a 4-byte length and
    raw snappy) or plain raw snappy."""
    if not data.startswith(_XERIAL):
        return bytes(cramjam.snappy.decompress_raw(data))
    out, at = [], 16
    while at < len(data):
        (n,) = struct.unpack_from(">i", data, at)
        out.append(bytes(cramjam.snappy.decompress_raw(data[at + 4:at + 4 + n])))
        at += 4 + n
    return b"".join(out)


def _varints(b: np.ndarray, pos: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """The zigzag varints starting at ``pos`` of ``b`` (padded with ``most`` zero bytes):
    (signed values, sizes); sizes are 0 where none ends within ``most`` bytes."""
    val = np.zeros(len(pos), _U64)
    size = np.zeros(len(pos), np.int64)
    open_ = np.ones(len(pos), bool)
    for k in range(most):
        byte = b[pos + k].astype(_U64)
        val |= np.where(open_, (byte & _U64(0x7F)) << _U64(7 * k), _U64(0))
        ends = open_ & (byte < 0x80)
        size[ends] = k + 1
        open_ &= ~ends
    signed = (val >> _U64(1)).astype(np.int64) ^ -(val & _U64(1)).astype(np.int64)
    return signed, size


def _record_starts(b: np.ndarray, n: int, length: int) -> np.ndarray:
    """The first bytes of the ``n`` records filling ``b[:length]``: every byte's would-be
    next record start is computed at once, then the chain from 0 is followed by doubling."""
    every = np.arange(length, dtype=np.int64)
    lens, sizes = _varints(b, every, 5)
    nxt = np.where((sizes > 0) & (lens >= 0), every + sizes + lens, length)
    nxt = np.minimum(nxt, length)
    jump = np.append(nxt, length)          # position ``length``: the end, which stays there
    starts = np.zeros(1, np.int64)
    while len(starts) < n:
        more = jump[starts]
        starts = np.concatenate((starts, more))
        jump = jump[jump]
    starts = starts[:n]
    if (starts[1:] <= starts[:-1]).any() or int(starts[-1]) >= length:
        raise batch.CorruptRecord("record lengths do not chain through the batch")
    return starts


def records_of(data) -> tuple[np.ndarray, np.ndarray, bytes, np.ndarray, bytes]:
    """(timestamps, key offsets, key bytes, value offsets, value bytes) of one batch."""
    b = batch.read(data, 0, check_crc=False)
    raw = decompress(b.codec, memoryview(data)[batch.HEADER_SIZE:b.size])
    n, length = b.count, len(raw)
    buf = np.frombuffer(raw + bytes(16), np.uint8)
    starts = _record_starts(buf, n, length)
    rlen, s0 = _varints(buf, starts, 5)
    end = starts + s0 + rlen
    p = starts + s0 + 1                      # past the length and the attributes
    tsd, s1 = _varints(buf, p, 10)
    p = p + s1
    _, s2 = _varints(buf, p, 5)              # offset delta
    p = p + s2
    klen, s3 = _varints(buf, p, 5)
    kpos = p + s3
    klen = np.maximum(klen, 0)
    p = kpos + klen
    vlen, s4 = _varints(buf, p, 5)
    vpos = p + s4
    vlen = np.maximum(vlen, 0)
    if not ((s0 > 0) & (s1 > 0) & (s2 > 0) & (s3 > 0) & (s4 > 0)).all() or (vpos + vlen > end).any() \
            or int(end[-1]) != length:
        raise batch.CorruptRecord("records do not fit their lengths")
    if b.attributes & batch.LOG_APPEND_TIME:
        ts = np.full(n, b.max_timestamp, np.int64)
    else:
        ts = b.base_timestamp + tsd
    ko, kb = _gather(buf, kpos, klen)
    vo, vb = _gather(buf, vpos, vlen)
    return ts, ko, kb, vo, vb


def _gather(buf: np.ndarray, pos: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, bytes]:
    off = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    total = int(off[-1])
    if not total:
        return off.astype("<u4"), b""
    idx = np.repeat(pos - off[:-1], lens) + np.arange(total)
    return off.astype("<u4"), buf[idx].tobytes()


def to_chunk(view) -> bytes:
    """A ``KAFKA`` chunk (its whole bytes) in kera's layout: same stream, streamlet, producer,
    sequence, placement and Kafka offset."""
    h = parse_header(view)
    ts, ko, kb, vo, vb = records_of(_batch(view))
    out = bytearray(build_arrays(h.stream_id, h.streamlet, h.producer_id, h.sequence, ts, ko,
                                       kb, vo, vb, h.flags & ~KAFKA))
    base = kafka_offset(view)
    if base is not None:
        set_kafka_offset(out, 0, base)
    place(out, 0, h.group, h.segment, h.offset)
    return bytes(out)
