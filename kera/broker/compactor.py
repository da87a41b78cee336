"""Key compaction (Kafka's ``cleanup.policy=compact``): closed segments keep the latest
record per key.

A stream with ``cleanup_policy`` ``compact`` (or ``compact,delete``) has its
*closed* segments rewritten in broker memory: a record survives when no later
record of the same key exists in the segments compacted together; a record
with an empty value is a *tombstone*, kept as the key's latest until
``delete_retention_ms`` after its timestamp, then removed (with every older
record of its key, which it superseded). Records without a key are kept.
"Later" is the append order: group id, then position (a compacted stream has one
active group per streamlet, so its groups follow one another).

What stays true (docs/compaction.md has the reasoning):

- **Positions do not change.** Each surviving chunk keeps its original
  placement (group, segment, offset); a reader's position maps to the first
  surviving chunk at or after it (``Compacted.span``). A reader in the middle
  of a compaction reads the old bytes or the new, whole: the swap is one
  assignment on the event loop, so no half-compacted segment is ever read.
- **Backups keep the originals.** Only segments whose chunks are settled on
  every copy are compacted, nothing is re-replicated, and their vsegs are
  frozen (the buffer the vlog would send from is gone). Recovery replays the
  originals (the state before compaction, every latest value in it) and the
  new owner compacts again. Segments left without a record are freed like
  expired ones (``Streamlet.drop_empty``): the vlog floors move past them and
  the backups delete their files; the originals of the others stay.
- **Never evicted.** A compacted stream's segments stay in memory (their
  compacted bytes exist nowhere else); memory is bounded by compaction itself,
  and a compacted stream whose live keys outgrow the budget is refused a new
  segment (``broker_full``). Compaction stops at a segment evicted before the
  stream became compacted.

Work per pass is bounded: the streamlet's already compacted segments plus at
most ``PASS_BYTES`` of new ("dirty") ones, started when the dirty bytes reach
the compacted ones (Kafka's ``min.cleanable.dirty.ratio`` 0.5), when a dirty
segment waited ``segment_ms`` (Kafka's ``max.compaction.lag.ms``), or when a
kept tombstone expires. The per-record work is numpy over the chunks' key columns
(keys up to ``EXACT_KEY`` bytes compared exactly, longer ones by xxh3-128),
run in a worker thread off the event loop.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import trio
import xxhash

from .. import chunk as chunkfmt
from . import retention
from .segment import Compacted, close_waiting

log = logging.getLogger("kera.broker")

INTERVAL = 0.5           # seconds between passes
PASS_BYTES = 64 << 20    # dirty segment bytes one pass takes at most
EXACT_KEY = 64           # keys up to this many bytes are compared byte for byte
BLOCK = 1 << 16         # records per block of the exact key comparison
DIRTY_RATIO = 1.0        # dirty bytes / compacted bytes that starts a pass (Kafka's 0.5 of the total)


def key_ids(kdata: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """One int per record, equal exactly when the records' keys are equal."""
    n = len(lens)
    width = int(lens.max()) if n else 0
    if width <= EXACT_KEY:
        # [length, key bytes, zero padding] as one fixed-width string per record
        cols = np.arange(width)
        rows = np.zeros((n, width + 1), dtype=np.uint8)
        rows[:, 0] = lens
        if width and len(kdata):
            for a in range(0, n, BLOCK):  # blocks bound the (records x width) index arrays
                s, ln = starts[a:a + BLOCK], lens[a:a + BLOCK]
                idx = np.minimum(s[:, None] + cols[None, :], len(kdata) - 1)
                rows[a:a + BLOCK, 1:] = np.where(cols[None, :] < ln[:, None], kdata[idx], 0)
        _, inv = np.unique(rows.view(f"S{width + 1}").ravel(), return_inverse=True)
        return inv
    raw = kdata.tobytes()
    ends = (starts + lens).tolist()
    digests = [xxhash.xxh3_128_digest(raw[s:e]) for s, e in zip(starts.tolist(), ends, strict=True)]
    _, inv = np.unique(np.array(digests, dtype="S16"), return_inverse=True)
    return inv


def survivors(views: list, now_ms: int, delete_retention_ms: int, drop_tombstones: bool,
              closed_ms=None):
    """Which records of ``views`` (chunks in reading order) survive: one bool array per chunk,
    and the time (ms) the oldest tombstone kept expires (None if none is kept). A tombstone
    ages from the later of its timestamp and ``closed_ms`` (per chunk: when the broker closed
    its segment), so a producer's old or zero timestamp never drops it early."""
    counts = np.array([len(v) for v in views], dtype=np.int64)
    koffs = [v.key_offsets for v in views]
    kdata = np.frombuffer(b"".join(v.key_data for v in views), dtype=np.uint8)
    kbase = np.zeros(len(views) + 1, dtype=np.int64)
    np.cumsum([int(k[-1]) for k in koffs], out=kbase[1:])
    starts = np.concatenate([k[:-1].astype(np.int64) + b for k, b in zip(koffs, kbase, strict=False)])
    klen = np.concatenate([np.diff(k.astype(np.int64)) for k in koffs])
    vlen = np.concatenate([np.diff(v.value_offsets.astype(np.int64)) for v in views])
    ts = np.concatenate([v.timestamps for v in views])
    if closed_ms is not None:
        ts = np.maximum(ts, np.repeat(np.asarray(closed_ms, dtype=np.int64), counts))
    ids = key_ids(kdata, starts, klen)
    n = len(ids)
    _, first_from_end = np.unique(ids[::-1], return_index=True)
    keep = np.zeros(n, dtype=bool)
    keep[n - 1 - first_from_end] = True
    keep |= klen == 0
    tomb = keep & (vlen == 0) & (klen > 0)
    if drop_tombstones and tomb.any():
        gone = tomb & (ts <= now_ms - delete_retention_ms)
        keep &= ~gone
        tomb &= ~gone
    due = int(ts[tomb].min()) + delete_retention_ms if tomb.any() else None
    return np.split(keep, np.cumsum(counts)[:-1]), due


def compact(segments: list, now_ms: int, delete_retention_ms: int, drop_tombstones: bool):
    """The pure part of a pass: ``segments`` are (segment, bytes) in reading order; returns
    ({segment: Compacted} for those that change, tombstone due time in ms)."""
    views, where = [], []
    for seg, data in segments:
        for h, off in chunkfmt.scan(data, verify_bodies=False):
            views.append(chunkfmt.ChunkView(data, off, h))
            where.append(seg)
    if not views:
        return {}, None
    keeps, due = survivors(views, now_ms, delete_retention_ms, drop_tombstones,
                           [int(seg.filled_at * 1000) for seg in where])
    by_seg: dict = {}
    for seg, view, keep in zip(where, views, keeps, strict=True):
        by_seg.setdefault(seg, []).append((view, keep))
    out = {}
    for seg, chunks in by_seg.items():
        if all(k.all() for _, k in chunks):
            continue
        parts, starts, ends, pends, at, records = [], [], [], [], 0, 0
        for view, keep in chunks:
            kept = np.flatnonzero(keep)
            if not len(kept):
                continue
            h = view.header
            data = view.buf if len(kept) == len(view) else chunkfmt.rewrite(view, kept)
            parts.append(data)
            starts.append(h.offset)
            ends.append(h.offset + h.size)
            at += len(data)
            pends.append(at)
            records += len(kept)
        out[seg] = Compacted(b"".join(parts), starts, ends, pends, records)
    return out, due


class Compactor:
    """The background passes of one broker incarnation (``run`` lives in its nursery)."""

    def __init__(self, streamlets: dict, compacted: dict, memory, free):
        self.streamlets = streamlets  # (stream id, index) -> Streamlet, the broker's own dict
        self.compacted = compacted    # the streamlets of compacted streams (the broker's ledger)
        self.memory = memory
        self.free = free              # the broker's: segments gone for good (memory, vseg lives)
        self.passes = 0
        self.records_in = 0     # records read by passes
        self.records_out = 0    # records they kept
        self.bytes_in = 0
        self.bytes_out = 0
        self.seconds = 0.0      # CPU time of the passes' worker threads

    async def run(self) -> None:
        while True:
            await trio.sleep(INTERVAL)
            await self.pass_once()

    async def pass_once(self) -> int:
        """Roll and compact every compacted streamlet that needs it; returns segments rewritten."""
        done = 0
        now = time.time()
        for sl in [sl for sl in self.compacted if not sl.recovering]:
            retention.roll(sl, now)
            job = self._job(sl, now)
            if job is None:
                continue
            try:
                done += await self._compact(sl, *job)
            except Exception as e:  # its segments stay as they are; readers unaffected
                log.exception("compacting stream %d streamlet %d failed: %s", sl.stream_id, sl.index, e)
        return done

    def _job(self, sl, now: float):
        """(segments, may drop tombstones), or None: the closed prefix of the streamlet in
        reading order, compacted ones and at most PASS_BYTES of dirty ones."""
        take, clean, dirty, oldest = [], 0, 0, now
        for seg in _prefix(sl):
            if seg.compacted is None:
                if dirty and dirty + seg.head > PASS_BYTES:
                    break
                dirty += seg.head
                oldest = min(oldest, seg.filled_at)
            else:
                clean += len(seg.compacted.buf)
            take.append(seg)
        # due when the dirty bytes reach the compacted ones, a dirty segment waited segment_ms
        # (a record is compacted within about twice that), or a tombstone kept expires
        due = sl.tombstone_due is not None and now >= sl.tombstone_due
        lag = dirty and now - oldest >= sl.segment_ms / 1000
        if take and (due or lag or (dirty and dirty >= DIRTY_RATIO * clean)):
            return take, True
        return None

    async def _compact(self, sl, take: list, drop_tombstones: bool) -> int:
        segments = [(seg, seg.compacted.buf if seg.compacted is not None else seg.view[:seg.head])
                    for seg in take]
        now_ms = int(time.time() * 1000)

        def work():
            t0 = time.thread_time()
            out = compact(segments, now_ms, sl.delete_retention_ms, drop_tombstones)
            return out, time.thread_time() - t0

        (result, due), cpu = await trio.to_thread.run_sync(work)
        # freed, evicted or unassigned meanwhile: this result describes bytes no longer served
        if any(seg.freed or seg.evicted for seg in take) or \
                self.streamlets.get((sl.stream_id, sl.index)) is not sl:
            return 0
        self.passes += 1
        self.seconds += cpu
        for seg in take:
            old = seg.compacted
            self.records_in += old.records if old is not None else _records(seg.view[:seg.head])
            self.bytes_in += len(old.buf) if old is not None else seg.head
            new = result.get(seg)
            if new is None and old is None:  # nothing dropped: clean as it is, no copy
                ends = list(seg.ends)
                new = Compacted(seg.view[:seg.head], [0, *ends[:-1]], ends, ends, _records(seg.view[:seg.head]))
            if new is not None:
                self._swap(seg, new)
            self.records_out += seg.compacted.records
            self.bytes_out += len(seg.compacted.buf)
        sl.tombstone_due = None if due is None else due / 1000
        self.free(retention.drop_empty(sl))
        return len(result)

    def _swap(self, seg, new: Compacted) -> None:
        """One assignment: readers see the old bytes or the new. The vsegs are frozen (the
        buffer their copies were made from is gone) and the memory charge becomes what the new
        bytes take (the old buffer itself when nothing was dropped: a view of it)."""
        for vs in seg.vsegs:
            vs.frozen = True
        self.memory.resident.pop(seg, None)
        held = len(new.buf.obj)
        self.memory.release(seg.held - held)
        seg.held = held
        seg.capacity = len(new.buf)
        seg.compacted = new
        seg.buf = None

    def stats(self) -> dict:
        return {"passes": self.passes, "records_in": self.records_in, "records_out": self.records_out,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "cpu_seconds": round(self.seconds, 3)}


def _prefix(sl):
    """The streamlet's segments in reading order up to the first that is not closed, durable,
    in memory and settled on its copies (an idle vlog's open vseg is closed for it)."""
    for gid in sorted(sl.groups):
        g = sl.groups[gid]
        for seg in g.segments[g.start:]:
            if not seg.filled_at or seg.evicted or seg.freed or seg.durable != seg.head:
                return
            if not seg.replicated():
                if close_waiting(seg):
                    seg.vlog.poke()
                return
            yield seg


def _records(data) -> int:
    """Records in back-to-back chunks (their headers only)."""
    return sum(h.record_count for h, _ in chunkfmt.scan(data, verify_bodies=False))
