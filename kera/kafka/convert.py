"""kera chunks as Kafka record batches and back, in numpy: no Python loop per record.

- ``wrap``: a Kafka producer's batch as one kera chunk (flag ``KAFKA``), the batch stored
  as it arrived (compressed or not), its base offset set to the partition's, padded to 8.
- ``batch_of``: the batch a ``KAFKA`` chunk holds (a view, no copy): what a Kafka consumer
  is served.
- ``to_batch``: a chunk of kera's own layout (kera's producer, compaction) as an
  uncompressed batch: each record's varint fields are sized and written for all records
  at once, keys and values gathered by index arrays, the CRC-32C computed in C.

The other way, a ``KAFKA`` chunk's records in kera's layout, is the chunk's own
(``kera.chunk.kafka_records``): every reader of a chunk meets it there.

A record with an empty key in kera is a null key in Kafka and back.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from .. import chunk
from ..chunk import kafka_batch as batch

_PAD = bytes(8)
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
