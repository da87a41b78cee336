"""The chunk: a producer-built batch of records for one streamlet.

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

``flags`` (one byte): ``SEQ_RESET`` marks the first chunk a producer sends
after giving up on earlier ones of the streamlet; the broker takes its
sequence as the producer's new base (see ``Streamlet.check_sequence``);
``INDEX`` marks an index chunk, which lives only in a virtual log
(``kera.recovery.index_chunk``); ``COMPACTED`` marks a chunk rewritten by key compaction (``rewrite``): it keeps the
placement of the chunk it came from, and after its values a uint32 array of
each surviving record's index in the original chunk, so a committed skip
count ("the first k records of the chunk at this position were consumed")
keeps its meaning (``skip_in`` / ``skip_out``).
Builders refuse more than ``limits.MAX_RECORDS`` records or ``limits.MAX_CHUNK``
bytes.
"""

from __future__ import annotations

import struct
import sys
import time
from array import array
from collections import namedtuple
from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import xxhash

from .errors import ChecksumError, LimitExceeded, ProtocolError, RecordTooLarge
from .limits import MAX_CHUNK, MAX_RECORDS

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
_TS = struct.Struct("<q")
_ZERO = (0,)
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
    return _seal_header(stream_id, streamlet, producer_id, sequence, n, ts_min, ts_max, body, flags)


def _seal_header(stream_id, streamlet, producer_id, sequence, n, ts_min, ts_max, body,
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
    return _seal_header(stream_id, streamlet, producer_id, sequence, n, int(ts.min()), int(ts.max()), body,
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
    # each chunk's header (zeros until its checksums are known) and index part, back to back
    fix = HEADER_SIZE + index
    at = np.zeros(k, np.int64)
    np.cumsum(fix[:-1], out=at[1:])
    fixed = np.zeros(int(fix.sum()), np.uint8)
    ts = np.asarray(timestamps, np.int64)
    fixed.view("<i8")[(at[owner] + HEADER_SIZE) // 8 + within] = ts
    koff = (at + HEADER_SIZE + 8 * counts) // 4
    voff = koff + counts + 1
    u32 = fixed.view("<u4")
    kcum, vcum = np.cumsum(klen), np.cumsum(vlen)
    u32[koff[owner] + 1 + within] = kcum - (kcum[first] - klen[first])[owner]
    u32[voff[owner] + 1 + within] = vcum - (vcum[first] - vlen[first])[owner]
    # [header and index part, keys..., values..., padding] per chunk, in one join (slices of
    # bytes, not views: nothing here is left for the cyclic collector to walk)
    per = 2 + (2 if keys is not None else 1) * counts
    slot = np.zeros(k, np.int64)
    np.cumsum(per[:-1], out=slot[1:])
    parts = np.empty(int(per.sum()), dtype=object)
    fb = fixed.tobytes()
    parts[slot] = [fb[a:a + z] for a, z in zip(at.tolist(), fix.tolist(), strict=True)]
    rec = slot[owner] + 1 + within
    if keys is not None:
        parts[rec] = keys
        rec = rec + counts[owner]
    parts[rec] = values
    parts[slot + per - 1] = _PADS[body - index - ksum - vsum]
    buf = bytearray().join(parts.tolist())
    mv = memoryview(buf)
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
    return buf, starts, sizes


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
            or h.body_len < 16 * h.record_count + 8:
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
            & (rc > 0) & (rc <= MAX_RECORDS) & (bl % 8 == 0) & (bl >= 16 * rc.astype(np.int64) + 8))


def place(buf, offset: int, group: int, segment: int, seg_offset: int) -> None:
    """Write the broker-assigned placement into a chunk held in ``buf`` (O(1))."""
    _PLACEMENT.pack_into(buf, offset + _PLACEMENT_AT, group, segment, seg_offset)
    mv = memoryview(buf)
    _HCHECK.pack_into(buf, offset + _CHECKED, xxhash.xxh32_intdigest(mv[offset:offset + _CHECKED]))


_FEW = 8   # records: a chunk of at most this many has its offsets checked without numpy
_OFFSETS = [struct.Struct(f"<{2 * n + 2}I") for n in range(_FEW + 1)]   # its key, then value offsets


class ChunkView:
    """Zero-copy access to a verified chunk's records through numpy views."""

    __slots__ = ("header", "buf", "_base")

    def __init__(self, buf, offset: int = 0, header: ChunkHeader | None = None):
        self.header = header or parse_header(buf, offset)
        self.buf = memoryview(buf)[offset:offset + self.header.size]
        self._base = HEADER_SIZE
        self._check_offsets()

    def _check_offsets(self) -> None:
        """Checksums say the bytes are the producer's; this says they make sense (a
        buggy producer's offsets must not make a reader slice garbage). A chunk of a few
        records is checked without numpy, whose calls cost more than the check (a reader
        of many small streams meets one-record chunks by the hundred thousand)."""
        n = len(self)
        room = self.header.body_len - 16 * n - 8
        if n <= _FEW:
            o = _OFFSETS[n].unpack_from(self.buf, self._base + 8 * n)
            k, v = o[:n + 1], o[n + 1:]
            if k[0] or v[0] or any(a > b for a, b in zip(k, k[1:], strict=False)) \
                    or any(a > b for a, b in zip(v, v[1:], strict=False)) or k[-1] + v[-1] > room:
                raise ProtocolError("chunk offsets are not increasing within its body")
            return
        k, v = self.key_offsets, self.value_offsets
        if k[0] or v[0] or (np.diff(k.astype(np.int64)) < 0).any() or (np.diff(v.astype(np.int64)) < 0).any() \
                or int(k[-1]) + int(v[-1]) > room:
            raise ProtocolError("chunk offsets are not increasing within its body")

    def __len__(self) -> int:
        return self.header.record_count

    @property
    def timestamps(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype="<i8", count=len(self), offset=self._base)

    @property
    def key_offsets(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype="<u4", count=len(self) + 1, offset=self._base + 8 * len(self))

    @property
    def value_offsets(self) -> np.ndarray:
        n = len(self)
        return np.frombuffer(self.buf, dtype="<u4", count=n + 1, offset=self._base + 8 * n + 4 * (n + 1))

    def _data_start(self) -> int:
        return self._base + 8 * len(self) + 8 * (len(self) + 1)

    @property
    def key_data(self) -> memoryview:
        s = self._data_start()
        return self.buf[s:s + int(self.key_offsets[-1])]

    @property
    def value_data(self) -> memoryview:
        s = self._data_start() + int(self.key_offsets[-1])
        return self.buf[s:s + int(self.value_offsets[-1])]

    def values(self) -> list[bytes]:
        data = bytes(self.value_data)
        o = self.value_offsets.tolist()
        return [data[o[i]:o[i + 1]] for i in range(len(self))]

    def keys(self) -> list[bytes | None]:
        data = bytes(self.key_data)
        o = self.key_offsets.tolist()
        return [data[o[i]:o[i + 1]] or None for i in range(len(self))]

    def records(self):
        """(key, value, timestamp) tuples; a convenience for clients, never used by servers."""
        return zip(self.keys(), self.values(), self.timestamps.tolist(), strict=False)


def original_indices(view: ChunkView) -> np.ndarray:
    """Each record's index in the chunk as the producer built it (``COMPACTED`` chunks keep
    the survivors' indices after their values; any other chunk is its own original)."""
    n = len(view)
    if not view.header.flags & COMPACTED:
        return np.arange(n, dtype=np.uint32)
    at = view._data_start() + int(view.key_offsets[-1]) + int(view.value_offsets[-1])
    if at + 4 * n > view.header.size:
        raise ProtocolError("compacted chunk without its original indices")
    return np.frombuffer(view.buf, dtype="<u4", count=n, offset=at)


def skip_in(view: ChunkView, consumed: int) -> int:
    """Records of ``view`` to skip when the first ``consumed`` records of its original were read."""
    if not consumed or not view.header.flags & COMPACTED:
        return consumed
    return int(np.searchsorted(original_indices(view), consumed))


def skip_out(view: ChunkView, skipped: int) -> int:
    """The inverse: how many records of the original the first ``skipped`` of ``view`` cover."""
    if not skipped or not view.header.flags & COMPACTED:
        return skipped
    return int(original_indices(view)[skipped - 1]) + 1


def _gather(data: np.ndarray, offsets: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Offsets and bytes of the variable-length items ``keep`` of an Arrow-style column."""
    starts = offsets[keep].astype(np.int64)
    lens = offsets[keep + 1].astype(np.int64) - starts
    out = np.zeros(len(keep) + 1, dtype="<u4")
    np.cumsum(lens, out=out[1:])
    total = int(out[-1])
    if not total:
        return out, b""
    idx = np.repeat(starts - out[:-1].astype(np.int64), lens) + np.arange(total)
    return out, data[idx].tobytes()


def rewrite(view: ChunkView, keep: np.ndarray) -> bytes:
    """The chunk with only the records ``keep`` (sorted indices, at least one): same stream,
    producer, sequence and placement, flagged ``COMPACTED``; numpy gathers, no per-record loop."""
    h = view.header
    n = len(keep)
    assert 0 < n <= len(view)
    ts = view.timestamps[keep]
    koff, kbytes = _gather(np.frombuffer(view.key_data, np.uint8), view.key_offsets, keep)
    voff, vbytes = _gather(np.frombuffer(view.value_data, np.uint8), view.value_offsets, keep)
    orig = original_indices(view)[keep].astype("<u4")
    raw = 16 * n + 8 + len(kbytes) + len(vbytes) + 4 * n
    body = b"".join((ts.astype("<i8").tobytes(), koff.tobytes(), voff.tobytes(), kbytes, vbytes,
                     orig.tobytes(), bytes(-raw % 8)))
    out = bytearray(_seal_header(h.stream_id, h.streamlet, h.producer_id, h.sequence, n, int(ts.min()),
                                 int(ts.max()), body, h.flags | COMPACTED))
    place(out, 0, h.group, h.segment, h.offset)
    return bytes(out)
