"""The ``kera`` PySpark data source: batch and streaming reads, batch and streaming writes."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)

from kera.errors import StreamExists

from ..admin import default_coordinator
from . import io, positions
from .arrow import SCHEMA
from .positions import Offsets

log = logging.getLogger("kera.spark")

DEFAULT_RECORD_BYTES = 128.0    # until a sample of the data says otherwise
DEFAULT_CHUNK_BYTES = 16384.0


def _opt(options, name: str, default=None):
    v = options.get(name.lower(), options.get(name))
    return default if v is None or v == "" else v


def _int(options, name: str, default):
    v = _opt(options, name)
    if v is None:
        return default
    try:
        return int(float(v))
    except ValueError:
        raise ValueError(f"kera option {name} must be a number, not {v!r}") from None


class ReadOptions:
    """The read options, parsed once on the driver (executors get them inside partitions)."""

    def __init__(self, options):
        self.coordinator = _opt(options, "coordinator") or default_coordinator()
        streams = _opt(options, "streams") or _opt(options, "stream") or ""
        self.names = [s.strip() for s in streams.split(",") if s.strip()]
        self.pattern = _opt(options, "pattern")
        if not self.names and not self.pattern:
            raise ValueError("kera source: set option 'streams' (a,b,c) or 'pattern' (sensor-*)")
        self.starting = _opt(options, "startingOffsets", "earliest")
        self.ending = _opt(options, "endingOffsets", "latest")
        self.max_records = _int(options, "maxRecordsPerTrigger", None)
        self.max_bytes = _int(options, "maxBytesPerTrigger", None)
        self.record_bytes = _opt(options, "avgRecordBytes")
        self.partition_bytes = _int(options, "partitionBytes", 32 << 20)
        self.min_partitions = _int(options, "minPartitions", os.cpu_count() or 1)
        self.max_partitions = _int(options, "maxPartitions", 1024)
        self.pull_bytes = _int(options, "pullBytes", 8 << 20)
        self.timeout = float(_opt(options, "readTimeout", 120))
        self.consumer_group = _opt(options, "consumerGroup")
        self.stats_file = _opt(options, "statsFile")
        self.settings = io.security(options)   # sent to the executors with each partition

    def metadata(self) -> dict:
        return io.metadata(self.coordinator, self.names, self.pattern, settings=self.settings)

    def offsets(self, spec: str, meta: dict, what: str) -> Offsets:
        """'earliest', 'latest' or JSON offsets, for the streams in ``meta``."""
        ids = {n: s.id for n, s in meta.items()}
        if spec.strip().lower() == "earliest":
            return Offsets(ids, {})
        if spec.strip().lower() == "latest":
            return io.latest(meta, self.coordinator, wait=self.timeout, settings=self.settings)
        try:
            return Offsets.from_json(spec).rebased(ids)
        except ValueError as e:
            raise ValueError(f"kera option {what}: {e}") from None


class KeraPartition(InputPartition):
    """Ranges of many streamlets for one Spark task (plain data: it is pickled)."""

    def __init__(self, coordinator: str, ranges: list, addrs: dict, pull_bytes: int,
                 timeout: float, stats_file: str | None, settings: tuple = ()):
        super().__init__(None)
        self.coordinator = coordinator
        self.settings = settings
        self.ranges = ranges
        self.addrs = addrs
        self.pull_bytes = pull_bytes
        self.timeout = timeout
        self.stats_file = stats_file

    def __repr__(self):
        return f"KeraPartition({len(self.ranges)} streamlet ranges)"


def _partitions(o: ReadOptions, start: Offsets, end: Offsets, meta: dict) -> list[KeraPartition]:
    rs = positions.ranges(start, end, meta)
    parts = positions.plan(rs, meta, o.partition_bytes, o.min_partitions, o.max_partitions)
    out = []
    for p in parts:
        addrs = {r.stream: meta[r.stream].addrs for r in p}
        out.append(KeraPartition(o.coordinator, [r.to_wire() for r in p], addrs, o.pull_bytes,
                                 o.timeout, o.stats_file, o.settings))
    return out


def _read(partition: KeraPartition) -> Iterator[pa.RecordBatch]:
    return io.read_ranges(partition.coordinator, partition.ranges, partition.addrs,
                          pull_bytes=partition.pull_bytes, timeout=partition.timeout,
                          stats_file=partition.stats_file, settings=partition.settings)


class KeraBatchReader(DataSourceReader):
    def __init__(self, options: ReadOptions):
        self.o = options

    def partitions(self):
        o = self.o
        meta = o.metadata()
        start = o.offsets(o.starting, meta, "startingOffsets")
        end = o.offsets(o.ending, meta, "endingOffsets")
        return _partitions(o, start, end, meta)

    def read(self, partition):
        if partition.value is None and not isinstance(partition, KeraPartition):
            return iter(())  # Spark's placeholder when there is nothing to read
        return _read(partition)


class KeraStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches between position offsets; see positions.py for the format."""

    def __init__(self, options: ReadOptions):
        self.o = options
        self.turn = 0
        self.target: Offsets | None = None   # Trigger.AvailableNow: stop here
        self.sizes: tuple[float, float] | None = None
        self.sampled_at = -1
        self.meta: dict = {}

    # -- offsets -------------------------------------------------------------------------
    def initialOffset(self) -> dict:
        self.meta = self.o.metadata()
        return self.o.offsets(self.o.starting, self.meta, "startingOffsets").to_json()

    def prepareForTriggerAvailableNow(self) -> None:
        self.meta = self.o.metadata()
        self.target = io.latest(self.meta, self.o.coordinator, wait=self.o.timeout,
                                settings=self.o.settings)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.o.max_bytes:
            return ReadMaxBytes(self.o.max_bytes)
        if self.o.max_records:
            return ReadMaxRows(self.o.max_records)
        return ReadAllAvailable()

    def _latest(self, start: Offsets) -> Offsets:
        if self.target is not None:
            meta = {n: s for n, s in self.o.metadata().items() if self.target.streams.get(n) == s.id}
            top = Offsets({n: s.id for n, s in meta.items()},
                          {k: v for k, v in self.target.positions.items() if k[0] in meta})
        else:
            meta = self.o.metadata()   # new streams matching the pattern join here
            top = io.latest(meta, settings=self.o.settings)
        self.meta = meta
        start = start.rebased(top.streams)
        merged = dict(start.positions)
        for key, v in top.positions.items():
            merged[key] = positions.merge_max(start.get(*key), v)
        return Offsets(top.streams, merged)

    def _budget(self, start: Offsets, top: Offsets, limit: ReadLimit) -> float:
        if isinstance(limit, ReadAllAvailable):
            return math.inf
        budget = math.inf
        if isinstance(limit, ReadMaxBytes):
            budget = limit.max_bytes
        if self.o.max_bytes:
            budget = min(budget, self.o.max_bytes)
        rows = limit.max_rows if isinstance(limit, ReadMaxRows) else self.o.max_records
        if rows:
            budget = min(budget, rows * self._sizes(start, top)[0])
        return budget

    def _sizes(self, start: Offsets, top: Offsets) -> tuple[float, float]:
        """(chunk bytes per record, bytes per chunk), sampled from the data every 100 batches;
        ``avgRecordBytes`` overrides the first."""
        if self.sizes is None or self.turn - self.sampled_at >= 100:
            rs = positions.ranges(start, top, self.meta)[:16]
            got = io.sample_sizes([r.to_wire() for r in rs], {n: s.addrs for n, s in self.meta.items()},
                                  settings=self.o.settings)
            if got:
                self.sizes, self.sampled_at = got, self.turn
        rec, chunk = self.sizes or (DEFAULT_RECORD_BYTES, DEFAULT_CHUNK_BYTES)
        if self.o.record_bytes:
            rec = float(self.o.record_bytes)
        return rec, chunk

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        self.turn += 1
        s = Offsets.from_json(start)
        top = self._latest(s)
        if isinstance(limit, ReadMinRows):
            est = positions.estimate_bytes(s, top, self.meta) / self._sizes(s, top)[0]
            if est < limit.min_rows:
                return start
            limit = ReadAllAvailable()
        budget = self._budget(s, top, limit)
        if budget == math.inf:
            end = top
        else:
            end, cuts = positions.admit(s, top, self.meta, budget, self.turn, self._sizes(s, top)[1])
            end = positions.apply_cuts(end, cuts, io.align(self.meta, cuts, self.o.settings))
        out = end.to_json()
        return start if out == start else out

    def reportLatestOffset(self):
        return None

    # -- reading -------------------------------------------------------------------------
    def partitions(self, start: dict, end: dict):
        s, e = Offsets.from_json(start), Offsets.from_json(end)
        meta = self.meta if all(n in self.meta and self.meta[n].id == i for n, i in e.streams.items()) \
            else io.metadata(self.o.coordinator, sorted(e.streams), strict=False,
                             settings=self.o.settings)
        return _partitions(self.o, s, e, meta)

    def read(self, partition):
        return _read(partition)

    def commit(self, end: dict) -> None:
        if self.o.consumer_group:  # lets `kera` tools see how far the query is
            e = Offsets.from_json(end)
            rt = io.Runtime.get(self.o.settings)
            try:
                rt.run(rt.group_positions(self.o.coordinator).commit, self.o.consumer_group,
                       e.to_json()["positions"], e.streams)
            except Exception as ex:  # monitoring only: never fail the query for it
                log.warning("committing positions to kera failed: %s", ex)


# -- writes ------------------------------------------------------------------------------

_PRODUCER_PREFIX = "producer."


class WriteOptions:
    def __init__(self, options):
        self.coordinator = _opt(options, "coordinator") or default_coordinator()
        self.stream = _opt(options, "stream")
        if not self.stream or "," in self.stream:
            raise ValueError("kera sink: set option 'stream' to one stream name")
        self.acks = _opt(options, "acks", "all")
        self.partitioner = _opt(options, "partitioner", "round-robin")
        self.producer = {"acks": self.acks}
        for k, v in options.items():
            if k.lower().startswith(_PRODUCER_PREFIX):
                self.producer[k[len(_PRODUCER_PREFIX):]] = _number(v)
        self.create = str(_opt(options, "create", "false")).lower() == "true"
        self.streamlets = _int(options, "streamlets", None)
        self.groups = _int(options, "groups", None)
        self.replication = _int(options, "replication", None)
        self.flush_timeout = float(_opt(options, "flushTimeout", 300))
        self.streamlet_count = 1  # set on the driver by _prepare_stream
        self.settings = io.security(options)


def _number(v):
    for t in (int, float):
        try:
            return t(v)
        except (TypeError, ValueError):
            pass
    return v


class KeraCommit(WriterCommitMessage):
    def __init__(self, records: int):
        self.records = records


def _check_schema(schema) -> None:
    names = {f.name.lower(): f for f in schema.fields}
    if "value" not in names:
        raise ValueError("writing to kera needs a 'value' column (binary or string); 'key' is optional")


def _binary(col) -> pa.Array:
    """A column as one binary array (Arrow's int32 offsets), nulls as empty values."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if not pa.types.is_binary(col.type):
        col = col.cast(pa.binary())
    if col.null_count:
        col = pa.compute.fill_null(col, b"")
    return col


def _columns(col: pa.Array) -> tuple[np.ndarray, memoryview]:
    """Offsets into the data buffer, and that buffer, of a binary array (zero-copy views)."""
    _, offsets, data = col.buffers()
    off = np.frombuffer(offsets, np.int32)[col.offset:col.offset + len(col) + 1]
    return off, memoryview(data) if data is not None else memoryview(b"")


def _write(o: WriteOptions, batches) -> KeraCommit:
    """Send every record of ``batches`` and wait until all are durable (acks=all).

    Arrow's value and key buffers go to ``send_columns`` as they are: no Python work per
    record, except hashing keys with the key partitioner (the rows are then grouped by
    streamlet with numpy)."""
    from ..partitioner import key_streamlet
    from ..producer import Producer

    n = 0
    with Producer(o.coordinator, config={**o.producer, **dict(o.settings)}) as p:
        by_key = o.partitioner == "key"
        for b in batches:
            if b.num_rows == 0:
                continue
            cols = {name.lower(): i for i, name in enumerate(b.schema.names)}
            values = _binary(b.column(cols["value"]))
            keys = b.column(cols["key"]) if "key" in cols else None
            if keys is not None and keys.null_count == len(keys):
                keys = None
            if keys is not None:
                keys = _binary(keys)
            if by_key and keys is not None:
                count = o.streamlet_count
                sl = np.fromiter((key_streamlet(k, count) if k else j % count  # hashing: per record
                                  for j, k in enumerate(keys.to_pylist())), np.int64, len(keys))
                order = np.argsort(sl, kind="stable")
                values, keys = values.take(order), keys.take(order)
                bounds = np.searchsorted(sl[order], np.arange(count + 1))
                parts = [(i, int(a), int(z)) for i, (a, z) in enumerate(pairwise(bounds)) if z > a]
            else:
                parts = [(None, 0, len(values))]
            for streamlet, a, z in parts:
                voff, vdata = _columns(values.slice(a, z - a))
                koff, kdata = _columns(keys.slice(a, z - a)) if keys is not None else (None, b"")
                p.send_columns(o.stream, voff, vdata, koff, kdata, streamlet=streamlet)
            n += b.num_rows
        p.flush(o.flush_timeout)
    return KeraCommit(n)


class KeraWriter(DataSourceArrowWriter):
    def __init__(self, options: WriteOptions):
        self.o = options

    def write(self, iterator) -> KeraCommit:
        return _write(self.o, iterator)

    def commit(self, messages) -> None:
        log.info("wrote %d records to kera stream %s",
                 sum(m.records for m in messages if m is not None), self.o.stream)

    def abort(self, messages) -> None:
        log.warning("write to kera stream %s aborted: records of finished tasks stay (at-least-once)",
                    self.o.stream)


class KeraStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: WriteOptions):
        self.o = options

    def write(self, iterator) -> KeraCommit:
        return _write(self.o, iterator)

    def commit(self, messages, batchId) -> None:
        pass

    def abort(self, messages, batchId) -> None:
        log.warning("micro-batch %s to kera stream %s aborted: records of finished tasks stay "
                    "(at-least-once)", batchId, self.o.stream)


def _prepare_stream(o: WriteOptions) -> None:
    """Create the target stream on the driver if asked to (option create=true)."""
    from ..admin import Admin

    with Admin(o.coordinator, config=dict(o.settings)) as a:
        if o.create:
            try:
                a.create_stream(o.stream, streamlets=o.streamlets, groups=o.groups,
                                replication=o.replication)
            except StreamExists:
                pass
        o.streamlet_count = a.describe_stream(o.stream).streamlets  # fails clearly if missing


# -- the data source ------------------------------------------------------------------

class KeraDataSource(DataSource):
    """``spark.dataSource.register(KeraDataSource)``, then ``format("kera")``."""

    @classmethod
    def name(cls) -> str:
        return "kera"

    def schema(self):
        return SCHEMA

    def reader(self, schema) -> KeraBatchReader:
        return KeraBatchReader(ReadOptions(self.options))

    def streamReader(self, schema) -> KeraStreamReader:
        return KeraStreamReader(ReadOptions(self.options))

    def writer(self, schema, overwrite: bool) -> KeraWriter:
        if overwrite:
            raise ValueError("kera streams are append-only: use mode('append')")
        _check_schema(schema)
        o = WriteOptions(self.options)
        _prepare_stream(o)
        return KeraWriter(o)

    def streamWriter(self, schema, overwrite: bool) -> KeraStreamWriter:
        _check_schema(schema)
        o = WriteOptions(self.options)
        _prepare_stream(o)
        return KeraStreamWriter(o)
