"""Tiered reads: the chunks of an evicted segment, fetched back from a backup's copy.

An evicted segment keeps, per chunk, the virtual segment (vseg) that holds it
and its byte offset there. A read asks, per vseg, one backup holding a copy
for exactly those chunks (``read_chunks``: offset ranges, no neighbours of
other streams), verifies every chunk again (checksums, and that its header
records this group, segment and offset), and lays them back into the
segment's bytes. Another copy is tried when one fails. The bytes are kept in
a small LRU cache (bounded), so a reader moving through a segment in several
pulls fetches it once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import trio

from .. import chunk as chunkfmt
from ..errors import BackupError, ChecksumError, KeraError, ProtocolError, Unavailable

log = logging.getLogger("kera.broker")

READ_TIMEOUT = 30.0


class TieredReader:
    def __init__(self, pool, identity: Callable[[], int], addr_of: Callable[[int], str],
                 cache_bytes: int):
        self.pool = pool
        self.identity = identity    # the broker id naming the replicas
        self.addr_of = addr_of      # backup id -> address (raises if it is not alive)
        self.cache_bytes = cache_bytes
        self.cache: OrderedDict = OrderedDict()  # segment -> bytes
        self.cached = 0
        self.reads = 0              # segments fetched
        self.bytes = 0              # their bytes
        self.seconds = 0.0          # time spent fetching (read rate = bytes / seconds)

    async def segment(self, seg, group: int) -> memoryview:
        """The evicted segment's bytes, [0, head)."""
        data = self.cache.get(seg)
        if data is not None:
            self.cache.move_to_end(seg)
            return memoryview(data)
        t0 = trio.current_time()
        buf = bytearray(seg.head)
        runs: list[tuple[object, list]] = []  # (vseg, [(vseg offset, size, segment offset)])
        by_id = {vs.id: vs for vs in seg.vsegs}
        start = 0
        places = seg.vplaces
        for vid, voff, end in zip(places[0::2], places[1::2], seg.ends, strict=True):
            if not runs or runs[-1][0].id != vid:
                runs.append((by_id[vid], []))
            runs[-1][1].append((voff, end - start, start))
            start = end
        failed: list[BackupError] = []
        async with trio.open_nursery() as n:
            for vs, chunks in runs:
                n.start_soon(self._fetch, seg, group, vs, chunks, buf, failed)
        if failed:   # a vseg no copy of which could be read (the others were read meanwhile)
            raise failed[0]
        self.reads += 1
        self.bytes += seg.head
        self.seconds += trio.current_time() - t0
        data = bytes(buf)
        if seg.evicted and not seg.freed and len(data) <= self.cache_bytes:
            self.cache[seg] = data
            self.cached += len(data)
            while self.cached > self.cache_bytes:
                _, old = self.cache.popitem(last=False)
                self.cached -= len(old)
        return memoryview(data)

    def forget(self, seg) -> None:
        data = self.cache.pop(seg, None)
        if data is not None:
            self.cached -= len(data)

    async def _fetch(self, seg, group: int, vs, chunks: list, buf: bytearray, failed: list) -> None:
        """``chunks`` of ``vs`` into ``buf``, from the first copy that serves them all
        verified; if none does, a ``BackupError`` saying why each failed goes to ``failed``."""
        errors = []
        for backup in sorted(vs.copies) or [None]:
            if backup is None:
                break
            try:
                addr = self.addr_of(backup)
            except Unavailable as e:   # not alive (a frozen vseg keeps its copy: it may come back)
                errors.append(f"backup {backup}: {e}")
                continue
            try:
                # an adopted segment's vsegs are a dead incarnation's (ForeignVseg names it)
                foreign = hasattr(vs, "broker")
                meta = {"broker": vs.broker if foreign else self.identity(),
                        "vlog": vs.vlog if foreign else seg.vlog.id, "vseg": vs.id,
                        "ranges": [[off, size] for off, size, _ in chunks]}
                _, payload = await self.pool.call(addr, "read_chunks", meta, timeout=READ_TIMEOUT)
                self._place(seg, group, chunks, memoryview(payload), buf)
                return
            except (KeraError, ProtocolError) as e:
                errors.append(f"backup {backup}: {e}")
                log.warning("reading evicted segment %d (vlog %d vseg %d) from backup %s: %s",
                            seg.id, seg.vlog.id, vs.id, backup, e)
        failed.append(BackupError(f"no copy of vlog {seg.vlog.id} vseg {vs.id} could be read: "
                                  f"{'; '.join(errors) or 'no copies left'}"))

    @staticmethod
    def _place(seg, group: int, chunks: list, payload: memoryview, buf: bytearray) -> None:
        """Verify each chunk (checksums, recorded placement) and put it where it was."""
        found = chunkfmt.scan(payload)
        if len(found) != len(chunks):
            raise ChecksumError(f"read back {len(found)} chunks, asked {len(chunks)}")
        for (h, off), (_, size, at) in zip(found, chunks, strict=True):
            if h.size != size or h.group != group or h.segment != seg.id or h.offset != at:
                raise BackupError(f"chunk read back is not the one placed at group {group} "
                                  f"segment {seg.id} offset {at}")
            buf[at:at + size] = payload[off:off + size]
