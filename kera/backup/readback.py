"""Reading replicas back: for a recovery (``read``, ``replay``, ``index``) and for a broker's
evicted segments (``read_chunks``, tiered storage).

Every chunk read from a file is verified again; a corrupt one is marked on its replica,
logged and never served (the caller asks another copy). File reads run in worker
threads beside the flush rounds (they read only what is written); a replica dropped
before or meanwhile is refused.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import numpy as np
import trio

from .. import chunk as chunkfmt
from .. import limits
from ..errors import BackupError, ChecksumError, InvalidArgument, KeraError, ProtocolError
from ..recovery.routes import parse_routes
from . import disk
from .fields import vseg_key
from .replay import replay
from .replica import Replica, VsegIndex, index_rows
from .store import BackupStore

log = logging.getLogger("kera.backup")



class ReadBack:
    """The backup's reads: handed the ``store`` (where a replica's bytes are), the service's
    ``counters`` and ``pool()`` (a replay pushes chunks to brokers)."""

    def __init__(self, store: BackupStore, counters: dict, pool: Callable):
        self.store, self.counters, self.pool = store, counters, pool

    def read_chunks(self, meta: dict):
        """Chunks of one replica by [offset, size] (a broker reading back an evicted segment),
        in the order asked: each from memory when it is there, else from the file and verified
        again; a corrupt one is never served."""
        rep = self.store.get(vseg_key(meta))
        ranges = self.store.chunk_ranges(rep, meta.get("ranges"))
        self.counters["tiered_reads"] += 1
        if all(off >= rep.mem_base for off, _ in ranges):
            parts = [p for off, size in ranges for p in rep.memory_parts(off, off + size)]
            self.counters["tiered_bytes"] += sum(size for _, size in ranges)
            return {"chunks": len(ranges)}, parts
        return self._read_chunks_file(rep, ranges)

    async def _read_chunks_file(self, rep: Replica, ranges):
        """Some of ``ranges`` are below the memory base: those are read from the file, the
        others taken from memory first (the views stay valid if a sync round frees the memory
        meanwhile; bytes above the base may not be in the file yet)."""
        base = rep.mem_base
        mem = {off: rep.memory_parts(off, off + size) for off, size in ranges if off >= base}
        below = [(off, size) for off, size in ranges if off < base]

        def work():
            out = []
            for off, size in below:
                data, bad = disk.read_verified(rep.path, off, off + size, [off], [off + size])
                if bad is not None:
                    return out, bad
                out.append(data)
            return out, None

        got, bad = await self.read_replica(rep, work)
        if bad is not None:
            self._rotten(rep, bad)
        read = dict(zip((off for off, _ in below), got, strict=True))
        parts = []
        for off, _ in ranges:
            parts.extend(mem[off] if off in mem else [read[off]])
        self.counters["tiered_bytes"] += sum(size for _, size in ranges)
        return {"chunks": len(ranges)}, parts

    async def index(self, meta: dict):
        """Closed, intact replicas' chunks without their bodies (a recovery re-pointing evicted
        history), for ``vsegs`` ([[vlog, vseg], ...] of ``broker``): one request per backup
        and batch, however long the history. Per vseg, in order, an ``answers`` entry and its
        bytes in the payload: ``{"rows": r, "bytes": n}`` (r bytes of rows, ``INDEX_COLUMNS``
        little-endian u64s per chunk from each verified header, Kafka offsets included,
        ``kera.wire.columns``; then its index chunks
        (``kera.recovery.index_chunk``), whole and verified, up to n), ``{"error": code, "message": m}``
        (missing, open, damaged: the caller asks another copy), or ``{"later": true}`` once
        the answer holds ``limits.INDEX_ANSWER`` bytes (asked again; the first vseg is never put off).
        A vseg asked as ``[vlog, vseg, true]`` gets rows of runs of chunks instead
        (``index_runs``: ``RUN_COLUMNS`` u64s, the last a count); as ``[vlog, vseg, runs,
        true]``, its chunks' bodies are read back and verified first (a copy a recovery
        would adopt from alone: rot in a body shows in no header), and one failing marks the
        replica corrupt and answers an error."""
        broker, vsegs = meta["broker"], meta["vsegs"]
        answers, parts, size, read = [], [], 0, 0
        for vlog, vseg, *how in vsegs:
            if size >= limits.INDEX_ANSWER or read >= limits.INDEX_VERIFY:
                answers.append({"later": True})
                continue
            try:
                rep = self.store.get((broker, vlog, vseg))
                if len(how) > 1 and how[1]:
                    read += await self._verify(rep)
                mine = await self._vseg_index(rep, bool(how and how[0]))
            except KeraError as e:
                answers.append({"error": e.code, "message": str(e)})
                continue
            n = sum(len(p) for p in mine)
            if size and size + n > limits.INDEX_ANSWER:  # the first one always goes (if a frame holds it)
                size = limits.INDEX_ANSWER
                answers.append({"later": True})
                continue
            if n > limits.MAX_PAYLOAD:
                answers.append({"error": BackupError.code, "message": f"index of vseg {vseg} is too large"})
                continue
            answers.append({"rows": len(mine[0]), "bytes": n})
            parts += mine
            size += n
            self.counters["indexes"] = self.counters.get("indexes", 0) + 1
        return {"answers": answers}, parts

    async def _vseg_index(self, rep: Replica, runs: bool) -> list:
        """One replica's index: its rows of chunks or of runs (kept since it closed,
        ``Replica.seal_index``, or made from its file's headers), then its index chunks."""
        if not rep.closed or rep.corrupt or rep.damaged:
            raise BackupError(f"replica {rep.key} is not closed and intact; not indexed")
        ix = rep.index or VsegIndex.of(await self._index_rows(rep), runs)
        parts = [ix.runs if runs else ix.rows]
        for s, n in ix.marks:  # one per run of adopted segments
            e = s + n
            if s >= rep.mem_base:
                parts.append(b"".join(rep.memory_parts(s, e)))
                continue
            parts.append(await self._read_checked(rep, s, e, [s], [e]))
        return parts

    async def _verify(self, rep: Replica) -> int:
        """Read back what ``rep`` holds in its file (below its memory base, bounded reads of
        ``limits.MAX_READ``) and verify every chunk; raise ``ChecksumError`` at the first that
        fails, marked corrupt. Bytes still in memory were verified as they came. Returns the
        bytes read."""
        if not rep.closed or rep.corrupt or rep.damaged:
            raise BackupError(f"replica {rep.key} is not closed and intact; not indexed")
        base, at = rep.mem_base, 0
        while at < base:
            _, stop, _, _ = rep.plan_read(at, limits.MAX_READ)
            starts, ends = BackupStore.chunk_bounds(rep, at, stop)
            await self._read_checked(rep, at, stop, starts, ends)
            self.counters["verified_bytes"] += stop - at
            at = stop
        return at

    async def _index_rows(self, rep: Replica) -> bytes:
        """The index rows of a replica that kept none: its headers gathered with one fancy
        index (from the mapped file, then from memory) and checked as arrays."""
        starts = np.frombuffer(rep.starts, np.uint64).astype(np.int64)
        ends = np.frombuffer(rep.ends, np.uint64).astype(np.int64)
        base = rep.mem_base   # taken before the file read: a sync round may free memory meanwhile
        cut = int(np.searchsorted(starts, base))  # chunks before it are read from the file
        memory = b"".join(rep.memory_parts(base, rep.length)) if cut < len(starts) else b""
        packed = b""
        if cut:
            packed = await self.read_replica(rep, disk.read_headers, rep.path, starts[:cut])
        if cut < len(starts):
            packed += disk.gather_headers(memory, starts[cut:] - base)
        h = np.frombuffer(packed, chunkfmt.HEADER_DTYPE)
        ok = chunkfmt.headers_ok(h, packed) \
            & (h["body_len"].astype(np.int64) + chunkfmt.HEADER_SIZE == ends - starts)
        if not ok.all():
            i = int(np.argmin(ok))
            s = int(starts[i])
            try:
                chunkfmt.parse_header(packed, i * chunkfmt.HEADER_SIZE)
                err = "its size disagrees with the replica's"
            except (ChecksumError, ProtocolError) as e:
                err = e
            raise ChecksumError(f"replica {rep.key}: header at {s}: {err}")
        return index_rows(starts, ends, h)

    def read(self, meta: dict):
        key = vseg_key(meta)
        offset = meta.get("offset") or 0
        max_bytes = min(max(meta.get("max_bytes") or limits.DEFAULT_READ, 1), limits.MAX_READ)
        rep, start, stop, corrupt_at, nxt, in_memory = self.store.plan_read(key, offset, max_bytes)
        self.counters["reads"] += 1
        if in_memory:
            parts = rep.memory_parts(start, stop) if stop > start else []
            self.counters["bytes_read"] += stop - start
            return BackupStore.read_meta(rep, nxt, corrupt_at), parts
        return self._read_file(rep, start, stop, corrupt_at, nxt)

    async def read_replica(self, rep: Replica, fn, *args):
        """``fn(*args)`` in a worker thread, reading ``rep``'s file: a replica dropped before
        or meanwhile (its file deleted, maybe made again for a new copy), or an I/O error, is a
        ``BackupError``. Not under the I/O lock: only bytes already written are read, so a
        flush round (its fsyncs take long while the disk writes back) never delays a read."""
        if rep.dropped:
            raise BackupError(f"replica {rep.key} was dropped")
        try:
            out = await trio.to_thread.run_sync(fn, *args)
        except OSError as e:
            if rep.dropped:
                raise BackupError(f"replica {rep.key} was dropped") from None
            raise BackupError(f"reading replica {rep.key}: {e}") from None
        if rep.dropped:  # what was read may be of another file: not served
            raise BackupError(f"replica {rep.key} was dropped")
        return out

    async def _read_checked(self, rep: Replica, start: int, stop: int, starts: list, ends: list) -> bytes:
        """[start, stop) of ``rep``'s file, every chunk (``starts``, ``ends``) verified; the
        first that fails is marked and raised (``_rotten``)."""
        data, bad = await self.read_replica(rep, disk.read_verified, rep.path, start, stop, starts, ends)
        if bad is not None:
            self._rotten(rep, bad)
        return data

    def _rotten(self, rep: Replica, bad: tuple) -> None:
        """Raise ``ChecksumError`` for the chunk ``bad`` that failed verification, marked."""
        off, _, reason = self.corrupt(rep, bad)
        raise ChecksumError(f"replica {rep.key}: chunk at {off} is corrupt: {reason}")

    def corrupt(self, rep: Replica, bad: tuple) -> tuple:
        """A chunk that failed verification on read: logged, marked, never served, and
        counted in ``damage`` (heartbeats carry it: brokers then ask what we hold)."""
        off, size, reason = bad
        log.error("replica %s: chunk at %d failed verification: %s; never served", rep.key, off, reason)
        if rep.mark_corrupt(off, size, reason):
            self.counters["damage"] += 1
        return bad

    async def _read_file(self, rep: Replica, start: int, stop: int, corrupt_at, nxt):
        starts, ends = BackupStore.chunk_bounds(rep, start, stop)
        data, bad = await self.read_replica(rep, disk.read_verified, rep.path, start, stop, starts, ends)
        if bad is not None:
            off, size, _ = self.corrupt(rep, bad)
            corrupt_at, nxt = off, off + size
        self.counters["bytes_read"] += len(data)
        return BackupStore.read_meta(rep, nxt, corrupt_at), data

    async def replay(self, meta: dict, payload):
        """Push one replica's chunks, from ``offset``, to the brokers recovering their streamlets.

        Stops at the copy's end or at its first corrupt chunk and says where
        (``next``, ``stopped``), so that another copy takes over from there.
        """
        key = vseg_key(meta)
        rep = self.store.get(key)
        routes = parse_routes(meta["owners"], payload)
        offset = meta.get("offset") or 0
        if offset > rep.length:
            raise InvalidArgument(f"offset {offset} beyond replica {key} of length {rep.length}")

        async def read(offset, max_bytes):
            res = self.read({"broker": key[0], "vlog": key[1], "vseg": key[2], "offset": offset,
                             "max_bytes": max_bytes})
            return await res if inspect.iscoroutine(res) else res

        out = await replay(read, self.pool(), routes, offset, rep.length,
                           {(sid, i, g): seg for sid, i, g, seg in meta.get("replay_from") or ()})
        log.info("replayed replica %s from %d: %s", key, offset, out)
        return out
