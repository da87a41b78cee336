"""The producer's columnar path: many records in, chunks built with numpy, no per-record work.

``send_many`` and ``send_columns`` take records as Arrow-style columns (offsets
into one buffer), cut them into chunks with ``cut`` and build each chunk whole
(``chunk.build_arrays``), so these chunks skip the open-chunk stage of
``accumulator`` and join their lanes' queues already packed, in sequence with
the records ``send`` queues on the same streamlets.
"""

from __future__ import annotations

import time
from itertools import pairwise

import numpy as np

from kera import chunk as chunkfmt
from kera.errors import KeraError

from .accumulator import Accumulator, Outgoing, too_large
from .delivery import BatchWaiter, Deliveries, Pending
from .lanes import Buffer, Waker
from .lookups import Lookups


def offsets(items) -> tuple[np.ndarray, bytes]:
    """Arrow-style offsets (int64[n + 1]) and the joined bytes of a list of byte strings."""
    off = np.zeros(len(items) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, items), np.int64, len(items)), out=off[1:])
    return off, b"".join(items)


def cut(size: np.ndarray, chunk_size: int, room: int) -> list[int]:
    """Chunk bounds over records of ``size`` bytes (16 + key + value): a chunk ends where its
    records reach ``chunk_size``, and never holds more than ``room`` (no record is larger)."""
    n = len(size)
    cum = np.cumsum(size)
    marks = np.arange(chunk_size, int(cum[-1]) + chunk_size, chunk_size)
    bounds = np.unique(np.clip(np.searchsorted(cum, marks, side="right"), 1, n))
    bounds = np.concatenate([[0], bounds[bounds < n], [n]]).tolist()
    # a chunk holds less than chunk_size plus its first record: one over room is cut where
    # room ends, and the rest (less than chunk_size) fits (one step per chunk, not per record)
    out = [0]
    for a, b in pairwise(bounds):
        base = int(cum[a - 1]) if a else 0
        if int(cum[b - 1]) - base > room:
            out.append(int(np.searchsorted(cum, base + room, side="right")))
        out.append(b)
    return out


class Columnar:
    """The producer's batch calls: chunks built whole, queued on their lanes through the
    ``Accumulator`` (sequences, round-robin), counted in the ``Buffer``."""

    def __init__(self, acc: Accumulator, lookups: Lookups, buffer: Buffer, delivery: Deliveries,
                 waker: Waker):
        self.acc, self.lookups, self.buffer, self.delivery, self.waker = \
            acc, lookups, buffer, delivery, waker
        self.producer_id = 0   # set by the producer once the coordinator issued it

    async def send_many(self, stream: str, values, keys=None, streamlet: int | None = None,
                        on_delivery=None, report: bool = False) -> Pending | None:
        """Send many records at once, packed into chunks with numpy.

        ``values`` is a list of bytes or a 2-D uint8 array (one row per record),
        ``keys`` an optional list (None: no key), stored but not used to
        partition: records go to ``streamlet`` (default: round-robin per chunk).
        """
        if isinstance(values, np.ndarray):
            if values.ndim != 2 or values.dtype != np.uint8:
                raise ValueError("values array must be 2-D uint8 (one row per record)")
            n, size = values.shape
            voff = np.arange(0, (n + 1) * size, size, dtype=np.int64)
            vdata = np.ascontiguousarray(values).reshape(-1)
        else:
            voff, vdata = offsets(values)
        koff, kdata = (None, b"") if keys is None else offsets([k or b"" for k in keys])
        return await self.send_columns(stream, voff, vdata, koff, kdata, None, streamlet, on_delivery, report)

    async def send_columns(self, stream: str, value_offsets, value_data, key_offsets=None,
                           key_data=b"", timestamps=None, streamlet: int | None = None,
                           on_delivery=None, report: bool = False) -> Pending | None:
        """Send records given as columns, Arrow's binary layout: ``value_offsets`` (int[n + 1])
        into ``value_data``, optionally the same for keys (length 0: no key) and int64
        millisecond ``timestamps``. Chunks are cut and packed with numpy: no per-record work.

        ``on_delivery(error, BatchReport)`` is called once, when all its chunks are acknowledged
        or given up on (``error``: the first failure); ``report=True`` returns a ``Pending``."""
        cb = Pending() if report else on_delivery
        w = None if cb is None else BatchWaiter(cb, stream)
        s = self.lookups.streams.get(stream) or await self.lookups.stream(stream)
        if streamlet is not None and not 0 <= streamlet < s.streamlets:
            raise ValueError(f"stream {stream!r} has streamlets 0 to {s.streamlets - 1}, not {streamlet}")
        voff = np.asarray(value_offsets, dtype=np.int64)
        koff = None if key_offsets is None else np.asarray(key_offsets, dtype=np.int64)
        n = len(voff) - 1
        if n <= 0:
            return self._closed(w, cb)
        ts = np.full(n, int(time.time() * 1000), np.int64) if timestamps is None \
            else np.asarray(timestamps, dtype=np.int64)
        size = np.diff(voff) + 16
        if koff is not None:
            size += np.diff(koff)
        room = s.room
        big = int(np.argmax(size))
        if int(size[big]) > room:  # refused before any of them leaves
            raise too_large(s, int(size[big]), f"record {big} of {n}")
        bounds = cut(size, min(self.acc.chunk_size, room), room)
        vdata, kdata = memoryview(value_data), memoryview(key_data)
        try:
            await self._queue_columns(s, bounds, voff, vdata, koff, kdata, ts, streamlet, w)
        except BaseException as e:   # cancelled or failed part-way: the report still comes, once
            if w is not None:
                with self.buffer.lock:
                    w.failed += n - w.queued
                    if w.error is None:
                        w.error = e if isinstance(e, KeraError) else KeraError(
                            f"send_columns stopped after {w.queued} of {n} records: {e!r}")
                self._closed(w, cb)
            raise
        return self._closed(w, cb)

    async def _queue_columns(self, s, bounds, voff, vdata, koff, kdata, ts, streamlet, w) -> None:
        buf = self.buffer
        for a, b in pairwise(bounds):
            v0, v1 = int(voff[a]), int(voff[b])
            if koff is None:
                ko, kb = np.zeros(b - a + 1, np.uint32), b""
            else:
                k0, k1 = int(koff[a]), int(koff[b])
                ko, kb = (koff[a:b + 1] - k0).astype(np.uint32), kdata[k0:k1]
            while buf.full():
                await buf.progress.wait()
            with buf.lock:
                sl = streamlet if streamlet is not None else s.rr
                if streamlet is None and s.streamlets > 1:
                    s.rr = (s.rr + 1) % s.streamlets
                lane = s.lane(sl)
                seq = lane.seq
                data = chunkfmt.build_arrays(s.id, sl, self.producer_id, seq, ts[a:b], ko,
                                             kb, (voff[a:b + 1] - v0).astype(np.uint32), vdata[v0:v1])
                c = Outgoing.packed(lane, seq, data, b - a, time.monotonic(), w)
                c.charged = len(data)
                buf.bytes += len(data)
                buf.records += b - a
                if w is not None:
                    w.pending += 1
                    w.queued += b - a
                    self.delivery.used = True
                self.acc.enqueue(lane, c)
            self.waker.notify()

    def _closed(self, w: BatchWaiter | None, cb):
        """A batch call has queued all its chunks: its report may now go out."""
        if w is None:
            return None
        with self.buffer.lock:
            self.delivery.close(w)
            self.buffer.space.notify_all()
        self.delivery.hand()
        return cb if isinstance(cb, Pending) else None

