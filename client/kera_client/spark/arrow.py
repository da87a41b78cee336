"""Chunks -> one ``pyarrow.RecordBatch``, with numpy over whole columns.

A chunk body already holds Arrow's binary layout: ``key_offsets`` and
``value_offsets`` are uint32[n + 1] into the key and value bytes. Python work
is O(1) per *chunk* (collect a few numpy views), never per record: offsets of
many chunks are concatenated and rebased in one vectorised step, and the key
and value bytes of all chunks are joined with one ``bytes.join`` (a memcpy per
chunk). A batch made of a single chunk uses the chunk's buffers in place.

Keys of length 0 mean "no key" and come out as null.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from kera import chunk as chunkfmt
from kera.chunk import kafka_records
from kera.errors import ProtocolError

SCHEMA = StructType([
    StructField("stream", StringType(), True),
    StructField("streamlet", IntegerType(), True),
    StructField("group", IntegerType(), True),
    StructField("position", LongType(), True),
    StructField("key", BinaryType(), True),
    StructField("value", BinaryType(), True),
    StructField("timestamp", TimestampType(), True),
    StructField("producer", LongType(), True),
])

# What Spark expects from a Python data source reader for SCHEMA (checked with equals()).
ARROW_SCHEMA = pa.schema([
    pa.field("stream", pa.string()),
    pa.field("streamlet", pa.int32()),
    pa.field("group", pa.int32()),
    pa.field("position", pa.int64()),
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("producer", pa.int64()),
])

MAX_BATCH_BYTES = (1 << 31) - 1  # int32 offsets of pa.binary()


class ChunkBatch:
    """Collects received chunks (numpy views into the pulled payload) until they become one
    RecordBatch. ``add`` costs a handful of O(1) operations per chunk."""

    __slots__ = ("names", "name_ids", "meta", "ts", "koffs", "voffs", "kdata", "vdata", "nbytes",
                 "records")

    def __init__(self):
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.meta: list[tuple] = []     # (name id, streamlet, group, chunk position, producer, count)
        self.ts: list[np.ndarray] = []
        self.koffs: list[np.ndarray] = []
        self.voffs: list[np.ndarray] = []
        self.kdata: list = []
        self.vdata: list = []
        self.nbytes = 0
        self.records = 0

    def __len__(self) -> int:
        return len(self.meta)

    def add(self, stream: str, streamlet: int, group: int, position: int, buf, offset: int = 0,
            header=None) -> None:
        """One verified chunk at ``buf[offset:]`` (its header already parsed, or parsed here)."""
        h = header or chunkfmt.parse_header(buf, offset)
        if h.flags & chunkfmt.KAFKA:   # a Kafka producer's batch: its records in this layout (numpy)
            buf, offset = kafka_records.to_chunk(memoryview(buf)[offset:offset + h.size]), 0
            h = chunkfmt.parse_header(buf)
        n = h.record_count
        body = offset + chunkfmt.HEADER_SIZE
        offs = np.frombuffer(buf, dtype="<u4", count=2 * n + 2, offset=body + 8 * n)
        kend, vend = int(offs[n]), int(offs[2 * n + 1])
        data = body + 16 * n + 8
        if data + kend + vend > offset + h.size:
            raise ProtocolError("chunk offsets point past its body")
        k = self.name_ids.get(stream)
        if k is None:
            k = self.name_ids[stream] = len(self.names)
            self.names.append(stream)
        mv = memoryview(buf)
        self.meta.append((k, streamlet, group, position, h.producer_id, n))
        self.ts.append(np.frombuffer(buf, dtype="<i8", count=n, offset=body))
        self.koffs.append(offs[:n + 1])
        self.voffs.append(offs[n + 1:])
        self.kdata.append(mv[data:data + kend])
        self.vdata.append(mv[data + kend:data + kend + vend])
        self.nbytes += h.size
        self.records += n

    def build(self) -> pa.RecordBatch:
        """The records added so far as one RecordBatch of ARROW_SCHEMA."""
        if not self.meta:
            return pa.RecordBatch.from_pylist([], schema=ARROW_SCHEMA)
        m = np.array(self.meta, dtype=np.int64)
        counts = m[:, 5]
        n = int(counts.sum())
        # per-record columns derived from per-chunk values: repeat, no Python loop
        name_idx = np.repeat(m[:, 0].astype(np.int32), counts)
        first = np.zeros(len(m), dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        position = np.repeat(m[:, 3] - first, counts) + np.arange(n, dtype=np.int64)
        ts = np.concatenate(self.ts) if len(self.ts) > 1 else self.ts[0]
        koffs, kdata = _binary(self.koffs, self.kdata, counts, n)
        voffs, vdata = _binary(self.voffs, self.vdata, counts, n)
        return pa.RecordBatch.from_arrays([
            pa.array(self.names, pa.string()).take(pa.array(name_idx)),
            pa.array(np.repeat(m[:, 1].astype(np.int32), counts), pa.int32()),
            pa.array(np.repeat(m[:, 2].astype(np.int32), counts), pa.int32()),
            pa.array(position, pa.int64()),
            _binary_array(koffs, kdata, nullable_empty=True),
            _binary_array(voffs, vdata, nullable_empty=False),
            pa.array(ts.astype(np.int64) * 1000, pa.timestamp("us", tz="UTC")),
            pa.array(np.repeat(m[:, 4], counts), pa.int64()),
        ], schema=ARROW_SCHEMA)


def _binary(offsets_list, data_list, counts, n: int):
    """One pa.binary() array's offsets and data from per-chunk uint32 offsets and byte views."""
    if len(offsets_list) == 1:
        offs32, data = offsets_list[0].view(np.int32), data_list[0]  # the chunk's own buffers
    else:
        ends = np.fromiter((len(d) for d in data_list), dtype=np.int64, count=len(data_list))
        total = int(ends.sum())
        if total > MAX_BATCH_BYTES:
            raise ValueError("batch too large for 32-bit Arrow offsets")
        bases = np.zeros(len(ends), dtype=np.int64)
        np.cumsum(ends[:-1], out=bases[1:])
        rebased = np.concatenate([o[:-1] for o in offsets_list]).astype(np.int64)
        rebased += np.repeat(bases, counts)
        offs32 = np.empty(n + 1, dtype=np.int32)
        offs32[:n] = rebased
        offs32[n] = total
        data = b"".join(data_list)
    if offs32[0] != 0 or (n and bool((offs32[1:] < offs32[:-1]).any())):
        raise ProtocolError("chunk offsets are not increasing")
    return offs32, data


def _binary_array(offs32: np.ndarray, data, nullable_empty: bool) -> pa.Array:
    n = len(offs32) - 1
    validity, nulls = None, 0
    if nullable_empty:
        present = offs32[1:] != offs32[:-1]
        nulls = n - int(np.count_nonzero(present))
        if nulls:
            validity = pa.py_buffer(np.packbits(present, bitorder="little"))
    return pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(offs32), pa.py_buffer(data)],
                                 null_count=nulls)
