"""Building chunks: one from a producer's records (``build``), one from columns
(``build_arrays``, the batch path: no per-record work at all), or many back to back in one
pass (``pack_many``: header fields and offsets as arrays over all the chunks).

Builders refuse more than ``limits.MAX_RECORDS`` records or ``limits.MAX_CHUNK`` bytes.
"""

from __future__ import annotations

import struct
import time
from array import array
from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import xxhash

from ..errors import LimitExceeded, RecordTooLarge
from ..limits import MAX_CHUNK, MAX_RECORDS
from .layout import (
    _CHECKED,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAGIC,
    NO_PLACEMENT,
    VERSION,
    _pad8,
    chunk_size,
    seal,
)

_TS = struct.Struct("<q")
_ZERO = (0,)


def _check_limits(n: int, data_bytes: int) -> None:
    if n > MAX_RECORDS:
        raise LimitExceeded(f"a chunk holds at most MAX_RECORDS ({MAX_RECORDS}) records, not {n}",
                            limit="MAX_RECORDS", bound=MAX_RECORDS, size=n)
    size = chunk_size(n, data_bytes)
    if size > MAX_CHUNK:
        raise RecordTooLarge(f"a chunk of {size} bytes exceeds MAX_CHUNK ({MAX_CHUNK} bytes)",
                             limit="MAX_CHUNK", bound=MAX_CHUNK, size=size)


def build(stream_id: int, streamlet: int, producer_id: int, sequence: int,
          values: Sequence[bytes], keys: Sequence[bytes | None] | None = None,
          timestamps=None, flags: int = 0) -> bytes:
    """Pack records into one chunk: one join per column, offsets by ``accumulate``.

    ``timestamps`` is a sequence (one per record) or one int for all of them
    (default: now). Small chunks are the common case on the send() path, so
    this avoids numpy's per-call overhead; ``build_arrays`` is the batch path.
    """
    n = len(values)
    if n == 0:
        raise ValueError("a chunk holds at least one record")
    voff = array("I", _ZERO)
    voff.extend(accumulate(map(len, values)))
    if keys is None:
        koff, kbytes = bytes(4 * (n + 1)), b""
        _check_limits(n, voff[-1])
    else:
        if len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} values")
        keys = [k or b"" for k in keys]
        ko = array("I", _ZERO)
        ko.extend(accumulate(map(len, keys)))
        _check_limits(n, voff[-1] + ko[-1])
        koff, kbytes = ko.tobytes(), b"".join(keys)
    if timestamps is None or isinstance(timestamps, int):
        t = int(time.time() * 1000) if timestamps is None else timestamps
        ts, ts_min, ts_max = _TS.pack(t) * n, t, t
    else:
        if len(timestamps) != n:
            raise ValueError(f"{len(timestamps)} timestamps for {n} values")
        arr = array("q", timestamps)
        ts, ts_min, ts_max = arr.tobytes(), min(arr), max(arr)
    vbytes = b"".join(values)
    if voff[-1] != len(vbytes) or n > 0xFFFFFFFF:
        raise ValueError("values overflow a chunk's 32-bit offsets")
    raw = 16 * n + 8 + len(kbytes) + len(vbytes)
    body = b"".join((ts, koff, voff.tobytes(), kbytes, vbytes, bytes(-raw % 8)))
    return seal(stream_id, streamlet, producer_id, sequence, n, ts_min, ts_max, body, flags)


def build_arrays(stream_id, streamlet, producer_id, sequence, ts, koff, kbytes, voff, vbytes,
                 flags: int = 0) -> bytes:
    """Pack already-columnar records (the batch path: no per-record work at all)."""
    n = len(ts)
    if n == 0 or len(koff) != n + 1 or len(voff) != n + 1 \
            or int(koff[-1]) != len(kbytes) or int(voff[-1]) != len(vbytes):
        raise ValueError("timestamps, offsets and key/value bytes disagree on the records")
    raw = len(kbytes) + len(vbytes)
    _check_limits(n, raw)
    body_len = _pad8(8 * n + 8 * (n + 1) + raw)
    pad = body_len - (8 * n + 8 * (n + 1) + raw)
    body = [ts.astype("<i8", copy=False).tobytes(), koff.astype("<u4", copy=False).tobytes(),
            voff.astype("<u4", copy=False).tobytes(), kbytes, vbytes, bytes(pad)]
    return seal(stream_id, streamlet, producer_id, sequence, n, int(ts.min()), int(ts.max()), body,
                        flags)


_PADS = np.array([bytes(i) for i in range(8)], dtype=object)


def pack_many(stream_ids, streamlets, producer_id: int, sequences, flags, counts, values,
              keys=None, timestamps=None) -> tuple[bytearray, list[int], list[int]]:
    """Pack many chunks back to back in one pass: what ``build`` makes, chunk after chunk.

    Chunk ``i`` holds the next ``counts[i]`` records of ``values`` (and ``keys``: None for
    no key at all, else one key or None per record) with int64 millisecond ``timestamps``
    (one per record). Header fields and offsets are numpy arrays over all chunks at once,
    the bytes are placed by one join; only the two checksums and the header's placing are
    a call per chunk. Returns the bytes and each chunk's start and size in them.
    """
    counts = np.asarray(counts, np.int64)
    k, n = len(counts), len(values)
    if k == 0 or int(counts.min()) < 1 or int(counts.sum()) != n:
        raise ValueError("chunk record counts disagree with the records")
    first = np.zeros(k, np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    owner = np.repeat(np.arange(k), counts)         # record -> its chunk
    within = np.arange(n) - first[owner]           # record -> its index in its chunk
    vlen = np.fromiter(map(len, values), np.int64, n)
    klen = np.zeros(n, np.int64)
    if keys is not None:
        keys = [x or b"" for x in keys]
        klen = np.fromiter(map(len, keys), np.int64, n)
    vsum, ksum = np.add.reduceat(vlen, first), np.add.reduceat(klen, first)
    _check_limits(int(counts.max()), 0)
    index = 16 * counts + 8                         # timestamps and the two offset arrays
    body = (index + ksum + vsum + 7) & ~7
    if int(body.max()) + HEADER_SIZE > MAX_CHUNK:
        i = int(body.argmax())
        _check_limits(int(counts[i]), int(ksum[i] + vsum[i]))
    ts = np.asarray(timestamps, np.int64)
    heads = _index_parts(counts, first, owner, within, index, ts, klen, vlen)
    buf = _joined(heads, counts, owner, within, keys, values, body - index - ksum - vsum)
    size = body + HEADER_SIZE
    start = np.zeros(k, np.int64)
    np.cumsum(size[:-1], out=start[1:])
    starts, sizes = start.tolist(), size.tolist()
    h = np.zeros(k, HEADER_DTYPE)
    h["magic"], h["version"], h["flags"] = MAGIC, VERSION, flags
    h["stream_id"], h["streamlet"], h["record_count"] = stream_ids, streamlets, counts
    h["producer_id"], h["sequence"] = producer_id, sequences
    h["ts_min"], h["ts_max"] = np.minimum.reduceat(ts, first), np.maximum.reduceat(ts, first)
    h["group"] = h["segment"] = h["offset"] = NO_PLACEMENT
    h["body_len"] = body
    _seal_many(buf, starts, sizes, h)
    return buf, starts, sizes


def _index_parts(counts, first, owner, within, index, ts, klen, vlen) -> list[bytes]:
    """Each chunk's header (zeros until its checksums are known) and index part (its
    timestamps and its key and value offsets), made back to back as one array."""
    fix = HEADER_SIZE + index
    at = np.zeros(len(counts), np.int64)
    np.cumsum(fix[:-1], out=at[1:])
    fixed = np.zeros(int(fix.sum()), np.uint8)
    fixed.view("<i8")[(at[owner] + HEADER_SIZE) // 8 + within] = ts
    koff = (at + HEADER_SIZE + 8 * counts) // 4
    voff = koff + counts + 1
    u32 = fixed.view("<u4")
    kcum, vcum = np.cumsum(klen), np.cumsum(vlen)
    u32[koff[owner] + 1 + within] = kcum - (kcum[first] - klen[first])[owner]
    u32[voff[owner] + 1 + within] = vcum - (vcum[first] - vlen[first])[owner]
    fb = fixed.tobytes()
    return [fb[a:a + z] for a, z in zip(at.tolist(), fix.tolist(), strict=True)]


def _joined(heads: list[bytes], counts, owner, within, keys, values, pads) -> bytearray:
    """[header and index part, keys..., values..., padding] per chunk, in one join (slices
    of bytes, not views: nothing here is left for the cyclic collector to walk)."""
    per = 2 + (2 if keys is not None else 1) * counts
    slot = np.zeros(len(counts), np.int64)
    np.cumsum(per[:-1], out=slot[1:])
    parts = np.empty(int(per.sum()), dtype=object)
    parts[slot] = heads
    rec = slot[owner] + 1 + within
    if keys is not None:
        parts[rec] = keys
        rec = rec + counts[owner]
    parts[rec] = values
    parts[slot + per - 1] = _PADS[pads]
    return bytearray().join(parts.tolist())


def _seal_many(buf: bytearray, starts: list[int], sizes: list[int], h: np.ndarray) -> None:
    """The headers ``h`` given their checksums (a call per chunk for each), then written in
    front of their bodies in ``buf``."""
    mv = memoryview(buf)
    k = len(h)
    b3 = xxhash.xxh3_64_intdigest
    h["body_checksum"] = np.fromiter((b3(mv[a + HEADER_SIZE:a + z]) for a, z in zip(starts, sizes, strict=True)),
                                     np.uint64, k)
    hb = h.tobytes()
    x32 = xxhash.xxh32_intdigest
    h["header_checksum"] = np.fromiter((x32(hb[i:i + _CHECKED]) for i in range(0, k * HEADER_SIZE, HEADER_SIZE)),
                                       np.uint32, k)
    hb = h.tobytes()
    for a, i in zip(starts, range(0, k * HEADER_SIZE, HEADER_SIZE), strict=True):
        mv[a:a + HEADER_SIZE] = hb[i:i + HEADER_SIZE]
