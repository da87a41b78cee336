"""Reading a chunk: zero-copy numpy views of its records (``ChunkView``); and its
compaction's rewrite, which keeps some records and each one's index in the original.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import ProtocolError
from .kafka_records import to_chunk
from .layout import (
    _RESERVED_AT,
    COMPACTED,
    HEADER_SIZE,
    KAFKA,
    ChunkHeader,
    parse_header,
    place,
    seal,
)

_FEW = 8   # records: a chunk of at most this many has its offsets checked without numpy
_OFFSETS = [struct.Struct(f"<{2 * n + 2}I") for n in range(_FEW + 1)]   # its key, then value offsets


class ChunkView:
    """Zero-copy access to a verified chunk's records through numpy views."""

    __slots__ = ("header", "buf", "_base")

    def __init__(self, buf, offset: int = 0, header: ChunkHeader | None = None):
        self.header = header or parse_header(buf, offset)
        self.buf = memoryview(buf)[offset:offset + self.header.size]
        self._base = HEADER_SIZE
        if self.header.flags & KAFKA:   # its records, converted to this layout (in numpy)
            self.buf = memoryview(to_chunk(self.buf))
            self.header = parse_header(self.buf)
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
    out = bytearray(seal(h.stream_id, h.streamlet, h.producer_id, h.sequence, n, int(ts.min()),
                                 int(ts.max()), body, (h.flags | COMPACTED) & ~KAFKA))
    out[_RESERVED_AT:_RESERVED_AT + 8] = view.buf[_RESERVED_AT:_RESERVED_AT + 8]
    place(out, 0, h.group, h.segment, h.offset)
    return bytes(out)
