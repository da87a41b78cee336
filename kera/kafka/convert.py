"""kera chunks as Kafka record batches and back, in numpy: no Python loop per record.

- ``wrap``: a Kafka producer's batch as one kera chunk (flag ``KAFKA``), the batch stored
  as it arrived (compressed or not), its base offset set to the partition's, padded to 8.
- ``batch_of``: the batch a ``KAFKA`` chunk holds (a view, no copy): what a Kafka consumer
  is served.
- ``to_batch``: a chunk of kera's own layout (kera's producer, compaction) as an
  uncompressed batch: each record's varint fields are sized and written for all records
  at once, keys and values gathered by index arrays, the CRC-32C computed in C.
- ``to_chunk``: a ``KAFKA`` chunk's records in kera's layout (what ``kera.chunk.ChunkView``
  reads, for kera's consumer, the Spark source and the key-value map): the batch is
  decompressed (gzip, snappy, lz4, zstd), then record starts are found by pointer doubling
  (each record's length is a varint at its start: the chain from the first record is
  followed log2(n) array gathers at a time, not record by record) and every field is read
  for all records at once. Kafka's record headers have no place in a kera chunk: they are
  dropped (keys, values and timestamps round-trip exactly).

A record with an empty key in kera is a null key in Kafka and back.
"""

from __future__ import annotations

import struct
import zlib

import cramjam
import numpy as np
import xxhash

from .. import chunk
from . import batch

_PAD = bytes(8)
_XERIAL = b"\x82SNAPPY\x00"
_U64 = np.uint64
_BASE = struct.Struct(">q")
_HCHECK = struct.Struct("<I")
_CHECKED = chunk.HEADER_SIZE - 4   # the header checksum covers what comes before it


def wrap(data, start: int, b: batch.Batch, stream_id: int, streamlet: int, producer: int,
         sequence: int, base: int) -> bytes:
    """The kera chunk holding the batch ``b`` (at ``start`` of ``data``) at offset ``base``."""
    return wrapped(data, start, b, stream_id, streamlet, producer, sequence, base)[0]


def wrapped(data, start: int, b: batch.Batch, stream_id: int, streamlet: int, producer: int,
            sequence: int, base: int) -> tuple[bytes, int]:
    """``wrap``'s chunk (not placed, its header sealed) and its body checksum: one join,
    one hash of the body, one of the header."""
    size = b.size
    body = b"".join((_BASE.pack(base), memoryview(data)[start + 8:start + size],
                     _PAD[:-size % 8] if size % 8 else b""))
    ts_min = b.base_timestamp
    ts_max = b.max_timestamp if b.max_timestamp >= ts_min else ts_min
    digest = xxhash.xxh3_64_intdigest(body)
    np_ = chunk.NO_PLACEMENT
    head = chunk.HEADER.pack(chunk.MAGIC, chunk.VERSION, chunk.KAFKA, stream_id, streamlet, b.count,
                             producer, sequence, ts_min, ts_max, np_, np_, np_, len(body), digest,
                             base + 1, 0)
    seal = _HCHECK.pack(xxhash.xxh32_intdigest(memoryview(head)[:_CHECKED]))
    return b"".join((memoryview(head)[:_CHECKED], seal, body)), digest


def batch_of(view, offset: int = 0) -> memoryview:
    """The record batch a ``KAFKA`` chunk at ``offset`` of ``view`` holds (no copy)."""
    at = offset + chunk.HEADER_SIZE
    return memoryview(view)[at:at + batch.length(view, at)]


# -- kera -> Kafka ------------------------------------------------------------------------
def _zigzag(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.int64)
    return ((x << 1) ^ (x >> 63)).astype(_U64)


def _vsize(u: np.ndarray) -> np.ndarray:
    """Bytes of each unsigned varint."""
    s = np.ones(len(u), np.int64)
    for k in range(1, 10):
        s += u >= _U64(1 << (7 * k))
    return s


def _put_varints(out: np.ndarray, pos: np.ndarray, u: np.ndarray, size: np.ndarray) -> None:
    for k in range(int(size.max()) if len(size) else 0):
        m = size > k
        byte = (u[m] >> _U64(7 * k)) & _U64(0x7F)
        byte |= np.where(size[m] - 1 > k, _U64(0x80), _U64(0))
        out[pos[m] + k] = byte.astype(np.uint8)


def _scatter(out: np.ndarray, dest: np.ndarray, data: np.ndarray, src: np.ndarray,
             lens: np.ndarray) -> None:
    """Copy ``lens[i]`` bytes from ``data[src[i]:]`` to ``out[dest[i]:]`` for every i at once."""
    total = int(lens.sum())
    if not total:
        return
    starts = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    within = np.arange(total) - np.repeat(starts, lens)
    out[np.repeat(dest, lens) + within] = data[np.repeat(src, lens) + within]


def to_batch(view, base: int, deltas: np.ndarray | None = None) -> bytes:
    """The records of ``view`` (a ``ChunkView`` of kera's layout) as one uncompressed batch
    whose first offset is ``base``; ``deltas``: each record's offset past it (a compacted
    chunk's original indices; by default 0, 1, 2, ...)."""
    n = len(view)
    ts = view.timestamps.astype(np.int64)
    ko = view.key_offsets.astype(np.int64)
    vo = view.value_offsets.astype(np.int64)
    klen, vlen = np.diff(ko), np.diff(vo)
    base_ts = int(ts[0])
    deltas = np.arange(n) if deltas is None else deltas.astype(np.int64)
    tsd, od = _zigzag(ts - base_ts), _zigzag(deltas)
    kl, vl = _zigzag(np.where(klen == 0, -1, klen)), _zigzag(vlen)
    stsd, sod, skl, svl = _vsize(tsd), _vsize(od), _vsize(kl), _vsize(vl)
    body = 1 + stsd + sod + skl + klen + svl + vlen + 1
    lenf = _zigzag(body)
    slen = _vsize(lenf)
    total = slen + body
    rec = np.zeros(n, np.int64)
    np.cumsum(total[:-1], out=rec[1:])
    rec += batch.HEADER_SIZE
    out = np.zeros(batch.HEADER_SIZE + int(total.sum()), np.uint8)
    _put_varints(out, rec, lenf, slen)
    p = rec + slen + 1
    _put_varints(out, p, tsd, stsd)
    p = p + stsd
    _put_varints(out, p, od, sod)
    p = p + sod
    _put_varints(out, p, kl, skl)
    p = p + skl
    _scatter(out, p, np.frombuffer(view.key_data, np.uint8), ko[:-1], klen)
    p = p + klen
    _put_varints(out, p, vl, svl)
    _scatter(out, p + svl, np.frombuffer(view.value_data, np.uint8), vo[:-1], vlen)
    buf = bytearray(out.tobytes())
    batch.HEADER.pack_into(buf, 0, base, len(buf) - batch.LOG_OVERHEAD, 0, batch.MAGIC, 0, 0,
                           int(deltas[-1]),
                           base_ts, int(ts.max()), -1, -1, -1, n)
    batch.seal(buf)
    return bytes(buf)


# -- Kafka -> kera ------------------------------------------------------------------------
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
    h = chunk.parse_header(view)
    ts, ko, kb, vo, vb = records_of(batch_of(view))
    out = bytearray(chunk.build_arrays(h.stream_id, h.streamlet, h.producer_id, h.sequence, ts, ko,
                                       kb, vo, vb, h.flags & ~chunk.KAFKA))
    base = chunk.kafka_offset(view)
    if base is not None:
        chunk.set_kafka_offset(out, 0, base)
    chunk.place(out, 0, h.group, h.segment, h.offset)
    return bytes(out)
