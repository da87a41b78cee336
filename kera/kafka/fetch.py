"""Fetch and ListOffsets: a partition's chunks read by dense offset, up to the durable head.

The high watermark is the end of the durable prefix of the partition's chunks (every copy
holds them: what kera's consumers read up to). A Fetch finds its offset's chunk with the
partition's ``OffsetLog`` and answers whole batches from there: a Kafka producer's chunk
as the batch it holds (a view of the segment, never copied), a kera producer's chunk
converted (``convert.to_batch``); chunks of segments evicted under the memory budget are
read back from a backup first, as kera's pull reads them (a partition no copy of whose
batches can be read is ``KAFKA_STORAGE_ERROR``, retriable; the others are answered). It
waits up to ``max_wait_ms`` for ``min_bytes``; it answers at most ``max_bytes`` and each
partition's ``partition_max_bytes``, but always the first batch (Kafka's KIP-74). An
offset below the log start or past the log end is ``OFFSET_OUT_OF_RANGE``; one between
the high watermark and the log end waits, as Kafka's does.
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import trio
from kio.schema.errors import ErrorCode

from .. import chunk
from ..errors import KeraError
from ..names import is_internal
from . import convert
from .framing import Records
from .produce import _held

log = logging.getLogger("kera.kafka")

MAX_WAIT = 30.0
LATEST, EARLIEST, MAX_TIMESTAMP = -1, -2, -3
_TS_MAX = struct.Struct("<q")
_TS_MAX_AT = 44


def handlers(gw) -> dict:
    return {"fetch": lambda c, r, v: _fetch(gw, c, r, v),
            "list_offsets": lambda c, r, v: _list_offsets(gw, c, r, v)}


def streamlet(broker, conn, topic: str, index: int, op: str = "read"):
    """The streamlet of a partition held here, or the error code saying why not."""
    if is_internal(topic) or not conn.peer.may(op, "stream", topic):
        return ErrorCode.topic_authorization_failed
    sid = broker.names.get(topic)
    sl = broker.streamlets.get((sid, index)) if sid is not None else None
    if sl is None:
        return ErrorCode.not_leader_or_follower
    if sl.recovering or (sl.pending and op != "write"):
        # pending: a dead broker's history is still being adopted, its offsets not indexed yet
        return ErrorCode.leader_not_available
    return sl


def _read(sl, offset: int, budget: int, first: bool):
    """(high watermark, log start, items, bytes) of durable chunks from ``offset``; an item
    is (base, chunk bytes or (segment, group, offset, size) to read back, compacted?)."""
    log = sl.kafka_log()
    held = _held(sl)
    hw, start = log.high_watermark(held), log.log_start(held)
    if offset < start or offset > log.next:
        return hw, start, None, 0
    items, size = [], 0
    i = log.find(offset)
    while i < log.durable:
        base, _, gid, si, off, n = log.row(i)
        i += 1
        seg = held(gid, si)
        if seg is None:
            continue
        if n > budget - size and not (first and not items):
            break
        if seg.compacted is not None:
            at, m, _ = seg.span(off, n)
            if at != off or not m:
                continue   # compacted away
            items.append((base, bytes(seg.part(at, m)), True))
        else:
            part = seg.part(off, n)
            items.append((base, part if part is not None else (seg, gid, off, n), False, offset))
        size += n
    return hw, start, items, size


async def _bytes(broker, items: list) -> list:
    """Each item's batch bytes: evicted segments read back, kera chunks converted. An item
    of an adopted segment may be a run of chunks (one row of its index): each chunk of it
    ending past the offset asked is a batch."""
    out = []
    for base, part, compacted, *asked in items:
        if isinstance(part, tuple):
            seg, gid, off, n = part
            part = memoryview(await broker.tiered.segment(seg, gid))[off:off + n]
        at = 0
        while at < len(part):
            h = chunk.parse_header(part, at)
            size = chunk.HEADER_SIZE + h.body_len
            c = part[at:at + size] if at or size < len(part) else part
            at += size
            if asked and base + h.record_count <= asked[0]:
                base += h.record_count
                continue
            if h.flags & chunk.KAFKA:
                out.append(convert.batch_of(c))
            else:
                view = chunk.ChunkView(c, 0, h)
                deltas = chunk.original_indices(view) if compacted else None
                out.append(convert.to_batch(view, base, deltas))
            base += h.record_count
    return out


async def _fetch(gw, conn, req, version):
    broker = gw.broker
    deadline = trio.current_time() + min(req.max_wait.total_seconds(), MAX_WAIT)
    max_bytes = req.max_bytes if version >= 3 else 1 << 30
    while True:
        event = broker.durable_event
        total, found, responses = 0, False, []
        for t in req.topics:
            parts = []
            for p in t.partitions:
                r = {"partition_index": p.partition, "high_watermark": -1, "last_stable_offset": -1,
                     "log_start_offset": -1, "aborted_transactions": None,
                     "preferred_read_replica": -1, "records": None}
                sl = streamlet(broker, conn, t.topic, p.partition)
                if isinstance(sl, ErrorCode):
                    r["error_code"] = sl
                    found = True
                else:
                    budget = max(0, min(p.partition_max_bytes, max_bytes - total))
                    hw, start, items, n = _read(sl, p.fetch_offset, budget, total == 0)
                    r.update(high_watermark=hw, last_stable_offset=hw, log_start_offset=start)
                    if items is None:
                        r["error_code"] = ErrorCode.offset_out_of_range
                        found = True
                    else:
                        r["error_code"], r["records"] = ErrorCode.none, items
                        total += n
                parts.append(r)
            responses.append({"topic": t.topic, "partitions": parts})
        if found or total >= req.min_bytes or trio.current_time() >= deadline:
            break
        with trio.move_on_at(deadline):
            await event.wait()
    counts = gw.counts
    for t in responses:
        for r in t["partitions"]:
            if r["records"] is not None:
                counts["fetch_batches"] += len(r["records"])
                try:
                    r["records"] = Records(await _bytes(broker, r["records"]))
                except KeraError as e:   # evicted batches no copy of which could be read
                    log.warning("Fetch of %s partition %d: %s", t["topic"], r["partition_index"], e)
                    r["error_code"], r["records"] = ErrorCode.kafka_storage_error, Records([])
            else:
                r["records"] = Records([])
            counts["fetch_partitions"] += 1
    counts["fetch_requests"] += 1
    broker.pulls += 1
    broker.bytes_out += total
    return {"throttle_time": 0, "error_code": ErrorCode.none, "session_id": 0, "responses": responses}


async def _chunk(broker, sl, i: int):
    """The chunk of row ``i`` (read back if evicted; None if freed or compacted away)."""
    _, _, gid, si, off, n = sl.kafka_log().row(i)
    seg = _held(sl)(gid, si)
    if seg is None:
        return None
    if seg.compacted is not None:
        at, m, _ = seg.span(off, n)
        return seg.part(at, m) if at == off and m else None
    part = seg.part(off, n)
    if part is None:
        part = memoryview(await broker.tiered.segment(seg, gid))[off:off + n]
    return part


async def _by_time(broker, sl, ts: int) -> tuple[int, int]:
    """(offset, timestamp) of the first record at or after ``ts``, (-1, -1) if none: a
    bisection over the chunks by their newest timestamp (a header field), then the one
    chunk's timestamps."""
    log = sl.kafka_log()
    lo, hi = log.first, log.durable
    while lo < hi:
        mid = (lo + hi) // 2
        c = await _chunk(broker, sl, mid)
        if c is None or _TS_MAX.unpack_from(c, _TS_MAX_AT)[0] < ts:
            lo = mid + 1
        else:
            hi = mid
    if lo >= log.durable:
        return -1, -1
    view = chunk.ChunkView(await _chunk(broker, sl, lo))
    stamps = view.timestamps
    k = int(np.argmax(stamps >= ts))
    return log.base(lo) + int(chunk.original_indices(view)[k]), int(stamps[k])


async def _list_offsets(gw, conn, req, version):
    broker = gw.broker
    topics = []
    for t in req.topics:
        parts = []
        for p in t.partitions:
            r = {"partition_index": p.partition_index, "timestamp": -1, "offset": -1,
                 "leader_epoch": -1}
            sl = streamlet(broker, conn, t.name, p.partition_index, "describe")
            if isinstance(sl, ErrorCode):
                r["error_code"] = sl
            else:
                log, held = sl.kafka_log(), _held(sl)
                hw = log.high_watermark(held)
                r["error_code"] = ErrorCode.none
                if p.timestamp in (LATEST, MAX_TIMESTAMP):
                    r["offset"] = hw
                elif p.timestamp == EARLIEST:
                    r["offset"] = log.log_start(held)
                else:
                    log.log_start(held)
                    r["offset"], r["timestamp"] = await _by_time(broker, sl, p.timestamp)
            parts.append(r)
        topics.append({"name": t.name, "partitions": parts})
    return {"throttle_time": 0, "topics": topics}
