"""BackupService: stores replicas of brokers' virtual segments, flushes them to disk.

A broker replicates each virtual segment of its virtual logs to R-1 backups
with ``replicate`` (many chunks per RPC, at an explicit byte offset so a
resend is recognised); the backup verifies every chunk's checksums (one call
per chunk, never per record), keeps the payload in memory as it came, and a
flusher task writes new bytes to segment files (``segment_file``) every
``--flush-interval`` and fsyncs every ``--fsync-interval``. With
``--fsync always`` a replicate is answered only once its bytes are written
and fsynced (group commit: one write + fsync per file per round, for every
replicate waiting). Segments are read back (``read``) only for recovery.

Failures are never silent: a write error is remembered on its replica and
reported to the next replicate (periodic mode) or to the waiting one (always
mode); while the disk is failing no new segment is accepted; ``--max-bytes``
is checked before data is accepted, so a full disk refuses data up front.

What is accepted, written, read or dropped is decided by ``store.BackupStore``
(sans-IO, tested alone); this module runs the file work it asks for in
threads (``disk``), the flusher, the durability waits and the RPCs.

Run: ``python -m kera.backup.service --dir DIR [--port 0] ...`` (the CLI's
``kera backup ...`` calls ``main(argv)``). When listening it prints one line
``backup <id> listening on HOST:PORT`` (``-`` while it has no id yet).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import signal
import sys

import numpy as np
import trio

from .. import chunk as chunkfmt
from .. import limits, metafile
from ..coordinator_link import CoordinatorLink
from ..errors import BackupError, ChecksumError, Fenced, InvalidArgument, KeraError, ProtocolError
from ..rpc import Service, open_pool
from . import disk, segment_file
from .claims import Claims
from .membership import load_id, run_membership
from .replay import parse_replay_from, parse_routes, replay
from .replica import Replica
from .store import DEFAULT_MAX_MEMORY, DUPLICATE, EMPTY, NEW, BackupStore, FlushJob, Key
from .store import MAX_REPLICATE_BYTES as MAX_REPLICATE_BYTES  # the limits, named here too
from .store import MAX_SEGMENT_BYTES as MAX_SEGMENT_BYTES

log = logging.getLogger("kera.backup")

SEGMENTS_DIR = "segments"
FLOORS_FILE = "floors.meta"    # (broker, vlog) -> vsegs below were released by their broker
INDEX_ANSWER = 16 << 20        # bytes of rows and index chunks one index answer carries
CLAIMS_FILE = "claims.meta"    # dead incarnations' vseg files that live owners read (claims)
MAX_READ_BYTES = limits.MAX_READ                    # one read reply (unless a single chunk is larger)
DEFAULT_READ_BYTES = 1 << 20
_U63 = 1 << 63


def _uint(meta: dict, name: str, default: int | None = None) -> int:
    v = meta.get(name, default)
    if type(v) is not int or not 0 <= v < _U63:
        raise InvalidArgument(f"{name!r} must be an integer in [0, 2^63), not {v!r}")
    return v


def _key(meta: dict) -> Key:
    return (_uint(meta, "broker"), _uint(meta, "vlog"), _uint(meta, "vseg"))


def _stable(payload) -> memoryview:
    """The payload as a byte view that nobody can change (no copy if it is one)."""
    mv = memoryview(payload)
    if isinstance(mv.obj, bytes) and mv.c_contiguous:
        return mv.cast("B") if mv.format != "B" else mv
    return memoryview(bytes(mv))


class BackupService(Service):
    def __init__(self, directory: str, *, fsync: str = "periodic", flush_interval: float = 0.05,
                 fsync_interval: float = 1.0, max_bytes: int = 0, max_memory: int = DEFAULT_MAX_MEMORY,
                 coordinator: str | None = None, node: str | None = None):
        if fsync not in ("periodic", "write", "always"):
            raise ValueError("fsync must be 'periodic', 'write' or 'always'")
        if flush_interval <= 0 or fsync_interval <= 0 or max_bytes < 0 or max_memory <= 0:
            raise ValueError("intervals and max_memory must be > 0, max_bytes >= 0")
        self.dir = directory
        self.segdir = os.path.join(directory, SEGMENTS_DIR)
        self.always = fsync == "always"
        self.write_through = fsync == "write"  # written (not fsynced) before the ack
        self.flush_interval = flush_interval
        self.fsync_interval = fsync_interval
        self.store = BackupStore(self.segdir, max_bytes=max_bytes, max_memory=max_memory)
        self.claims = Claims()
        self._claims_changed = self._claims_saved = 0   # changes made, changes on disk
        self.coordinator = coordinator
        self.node = node
        self.id: int | None = load_id(directory) if os.path.isdir(directory) else None
        self.epoch: int | None = None
        self.port: int | None = None
        self._dir_dirty = False
        self.stopping = False
        self.counters = dict.fromkeys(
            ("replicate_rpcs", "chunks", "bytes_received", "duplicates", "bytes_flushed", "fsyncs",
             "errors", "write_errors", "reads", "bytes_read", "drops", "trims", "tiered_reads",
             "tiered_bytes", "claims", "releases"), 0)
        self._io: trio.Lock | None = None
        self._kick: trio.Event | None = None
        self._round_done: trio.Event | None = None
        self._stop: trio.Event | None = None
        self.registered: trio.Event | None = None

    # -- lifecycle -----------------------------------------------------------

    async def run(self, host: str = "127.0.0.1", port: int = 0, *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Reload DIR, serve, flush; returns after ``stop()`` with everything fsynced."""
        self._io, self._kick, self._round_done = trio.Lock(), trio.Event(), trio.Event()
        self._stop, self.registered = trio.Event(), trio.Event()
        self._floors_lock = trio.Lock()
        await self.reload()
        async with open_pool() as pool, trio.open_nursery() as nursery:
            self.pool = pool
            self.port = await nursery.start(self.serve, host, port)
            nursery.start_soon(self._flusher)
            if self.coordinator:
                adv = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
                nursery.start_soon(run_membership, self, CoordinatorLink(pool, self.coordinator),
                                   f"{adv}:{self.port}", self.node)
            task_status.started(self.port)
            await self._stop.wait()
            with trio.CancelScope(shield=True):
                await self._final_flush()
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        self._stop.set()

    async def _final_flush(self) -> None:
        """Refuse new data, then write and fsync everything accepted (trailers too)."""
        self.stopping = True
        dirty = self.store.dirty
        for _ in range(50):  # a file still being created gets the io lock between rounds
            await self._flush_round(fsync=True)
            if all(rep.error for rep in dirty):
                break
        if dirty:
            log.error("exiting with %d replicas not fully on disk (%d bytes)", len(dirty),
                      self.store.unflushed)
        else:
            log.info("all replicas flushed and fsynced")

    async def reload(self) -> None:
        """Load every segment file: verify all chunks, cut torn tails, report corruption."""
        loaded = await trio.to_thread.run_sync(disk.load_dir, self.segdir)
        for ld, key in loaded:
            rep = Replica.from_loaded(ld, key)
            rep.ready = trio.Event()
            rep.ready.set()
            self.store.load(rep, ld.file_size)
        if loaded:
            log.info("reloaded %d segment files (%d bytes)", len(loaded), self.store.committed)
        floors = await trio.to_thread.run_sync(metafile.load, os.path.join(self.dir, FLOORS_FILE), [])
        for b, v, f in floors:
            self.store.raise_floor(b, v, f)
        self.claims.load(await trio.to_thread.run_sync(metafile.load,
                                                       os.path.join(self.dir, CLAIMS_FILE), []))
        await self._release_below_floor(self.store.below_floor())  # released before a crash
        await self._delete_unclaimed()  # dropped, last claim released before a crash

    async def _save_claims(self) -> None:
        """Persist the claims as they are now; concurrent changes share one write."""
        self._claims_changed += 1
        mine = self._claims_changed
        async with self._floors_lock:
            if self._claims_saved >= mine:
                return  # a write that began after our change covered it
            now, body = self._claims_changed, self.claims.dump()
            await trio.to_thread.run_sync(metafile.save, os.path.join(self.dir, CLAIMS_FILE), body)
            self._claims_saved = now

    async def _release_below_floor(self, reps) -> int:
        """Delete the files of vsegs below their vlog's floor, except those an owner claimed
        (read by adopted segments): those are only marked dropped, deleted with the last claim."""
        freed, marked = 0, False
        for rep in reps:
            if self.claims.drop(rep.key):
                marked = True
            else:
                freed += await self._release(rep)
        if marked:
            await self._save_claims()
        return freed

    async def _delete_unclaimed(self) -> int:
        """Delete the dropped files no claim holds any more; the bytes they took."""
        freed = 0
        due = self.claims.due()
        for key in due:
            if self.claims.claimed(key):   # claimed again while an earlier file was deleted
                continue
            rep = self.store.replicas.get(key)
            if rep is not None:
                freed += await self._release(rep)
            self.claims.deleted(key)
        if due:
            await self._save_claims()
        return freed

    async def _release(self, rep: Replica) -> int:
        """Delete the file of a released vseg; the bytes it took."""
        size = rep.budget
        if self.store.drop(rep.key) is None:
            return 0
        await self._unlink([rep])
        self.store.reclaimed += size
        return size

    def holds(self) -> list[list]:
        return self.store.holds()

    # -- replicate -----------------------------------------------------------

    def rpc_replicate(self, meta: dict, payload):
        self.counters["replicate_rpcs"] += 1
        try:
            return self._replicate(meta, payload)
        except KeraError:
            self.counters["errors"] += 1
            raise

    def _replicate(self, meta: dict, payload):
        if self.stopping:
            raise BackupError("backup shutting down")
        key = _key(meta)
        epoch, offset = _uint(meta, "epoch", 0), _uint(meta, "offset")
        close = meta.get("close", False) is True
        d = self.store.replicate(key, epoch, offset, _stable(payload), close)
        if d.kind == EMPTY:
            return {"length": 0}
        if d.kind == DUPLICATE:
            self.counters["duplicates"] += 1
            return self._ack(d.replica, d.length, close)
        rep = d.replica
        self.counters["chunks"] += d.chunks
        self.counters["bytes_received"] += d.take
        if d.kind == NEW:
            rep.ready = trio.Event()
            return self._first_replicate(rep, d.length, close)
        return self._ack(rep, d.length, close)

    def _ack(self, rep: Replica, end: int, close: bool):
        if rep.ready.is_set() and not (self.always or self.write_through):
            return {"length": end}
        return self._ack_later(rep, end, close)

    async def _first_replicate(self, rep: Replica, end: int, close: bool):
        with trio.CancelScope(shield=True):  # a creation is finished even if the caller goes away
            await self._create_file(rep)
        return await self._ack_later(rep, end, close)

    async def _ack_later(self, rep: Replica, end: int, close: bool):
        try:
            await rep.ready.wait()
            if rep.failed:
                raise BackupError(rep.failed)
            if self.always or self.write_through:
                def on_disk() -> bool:
                    if self.always:
                        return rep.synced >= end and (not close or rep.trailer_synced)
                    return rep.flushed >= end and (not close or rep.trailer_written)

                while not on_disk():
                    if rep.dropped:
                        raise BackupError(f"replica {rep.key} was dropped")
                    if rep.error:
                        raise BackupError(f"replica {rep.key}: {rep.error}")
                    done = self._round_done
                    self._kick.set()
                    await done.wait()
        except BackupError:
            self.counters["errors"] += 1
            raise
        return {"length": end}

    async def _create_file(self, rep: Replica) -> None:
        try:
            async with self._io:
                if rep.dropped:
                    raise BackupError(f"replica {rep.key} was dropped")
                await trio.to_thread.run_sync(segment_file.create, rep.path, rep.broker, rep.vlog,
                                              rep.vseg, rep.epoch, self.always)
            rep.created = True
            self._dir_dirty = not self.always
        except (OSError, BackupError) as e:
            rep.failed = f"cannot create replica {rep.key}: {e}"
            if isinstance(e, OSError):
                log.error("%s", rep.failed)
                self.store.disk_error = rep.failed
                self.counters["write_errors"] += 1
            self._forget(rep)
        finally:
            rep.ready.set()

    def _forget(self, rep: Replica) -> None:
        if self.store.forget(rep) and self._kick is not None:
            self._kick.set()  # wake durability waiters so they see it

    # -- flushing --------------------------------------------------------------

    async def _flusher(self) -> None:
        next_fsync = trio.current_time() + self.fsync_interval
        while True:
            with trio.move_on_after(self.flush_interval):
                await self._kick.wait()
            self._kick = trio.Event()
            done, self._round_done = self._round_done, trio.Event()
            now = trio.current_time()
            fsync = self.always or now >= next_fsync
            try:
                await self._flush_round(fsync)
            finally:
                done.set()
            if fsync:
                next_fsync = now + self.fsync_interval

    async def _flush_round(self, fsync: bool) -> None:
        """Write what the store says is due (new bytes, trailers), fsync if asked; report back."""
        store = self.store
        async with self._io:
            jobs: list[FlushJob] = store.flush_jobs(fsync)
            dir_sync = fsync and self._dir_dirty
            probe = store.disk_error is not None and not jobs
            if not (jobs or dir_sync or probe):
                return
            results, extra = await trio.to_thread.run_sync(
                disk.write_round, [(j.replica.path, j.start, j.parts, j.trailer, j.sync) for j in jobs],
                self.segdir, dir_sync, probe)
        ok = False
        for job, err in zip(jobs, results, strict=True):
            rep = job.replica
            if rep.dropped:
                continue
            if err is not None:
                msg = f"writing {os.path.basename(rep.path)} failed: {err}"
                if store.flush_failed(rep, msg):
                    log.error("replica %s: %s", rep.key, msg)
                    self.counters["write_errors"] += 1
                continue
            ok = True
            if rep.error:
                log.info("replica %s: written again after failure", rep.key)
            store.flush_done(job)
            self.counters["bytes_flushed"] += job.upto - job.start
            self.counters["fsyncs"] += job.sync
        if extra is not None:
            if dir_sync or store.disk_error is None:
                log.error("segment directory: %s", extra)
            store.disk_error = f"segment directory: {extra}"
        else:
            if dir_sync:
                self._dir_dirty = False
            if ok or probe:
                store.disk_error = None
        store.relieve_memory()

    # -- list / read / drop / stats ------------------------------------------

    def rpc_list(self, meta: dict, payload):
        b = meta.get("broker")
        return {"backup": self.id, "segments": self.store.listing(b), "floors": self.store.floor_list(b)}

    async def rpc_trim(self, meta: dict, payload):
        """The broker released the vsegs of a vlog below ``floor`` (nothing live in them):
        the floor is recorded first (a recovery then knows they are not lost), then their
        files are deleted."""
        b, v, floor = _uint(meta, "broker"), _uint(meta, "vlog"), _uint(meta, "floor")
        self.counters["trims"] += 1
        if self.store.raise_floor(b, v, floor):
            body = self.store.floor_list()
            async with self._floors_lock:
                await trio.to_thread.run_sync(metafile.save, os.path.join(self.dir, FLOORS_FILE), body)
        return {"bytes": await self._release_below_floor(self.store.below_floor(b, v))}

    def rpc_read_chunks(self, meta: dict, payload):
        """Chunks of one replica by [offset, size] (a broker reading back an evicted segment):
        each verified again when it comes from the file; a corrupt one is never served."""
        rep = self.store.get(_key(meta))
        ranges = self.store.chunk_ranges(rep, meta.get("ranges"))
        self.counters["tiered_reads"] += 1
        if all(off >= rep.mem_base for off, _ in ranges):
            parts = [p for off, size in ranges for p in rep.memory_parts(off, off + size)]
            self.counters["tiered_bytes"] += sum(size for _, size in ranges)
            return {"chunks": len(ranges)}, parts
        return self._read_chunks_file(rep, ranges)

    async def _read_chunks_file(self, rep: Replica, ranges):
        def work():
            out = []
            for off, size in ranges:
                data, bad = disk.read_verified(rep.path, off, off + size, [off], [off + size])
                if bad is not None:
                    return out, bad
                out.append(data)
            return out, None

        parts, bad = await self._read_replica(rep, work)
        if bad is not None:
            off, size, reason = self._corrupt(rep, bad)
            raise ChecksumError(f"replica {rep.key}: chunk at {off} is corrupt: {reason}")
        self.counters["tiered_bytes"] += sum(len(p) for p in parts)
        return {"chunks": len(parts)}, parts

    async def rpc_index(self, meta: dict, payload):
        """Closed, intact replicas' chunks without their bodies (a recovery re-pointing evicted
        history), for ``vsegs`` ([[vlog, vseg], ...] of ``broker``): one request per backup
        and batch, however long the history. Per vseg, in order, an ``answers`` entry and its
        bytes in the payload: ``{"rows": r, "bytes": n}`` (r bytes of rows, 10 little-endian
        u64s per chunk: vseg offset, size, stream, streamlet, group, segment, segment offset,
        producer, sequence, flags, from each verified header; then its index chunks
        (``kera.index_chunk``), whole and verified, up to n), ``{"error": code, "message": m}``
        (missing, open, damaged: the caller asks another copy), or ``{"later": true}`` past
        ``INDEX_ANSWER`` bytes (asked again)."""
        broker = _uint(meta, "broker")
        vsegs = meta.get("vsegs")
        if not isinstance(vsegs, list) or not vsegs or not all(
                isinstance(v, list) and len(v) == 2 and all(type(x) is int and 0 <= x < _U63 for x in v)
                for v in vsegs):
            raise InvalidArgument("index needs vsegs: [[vlog, vseg], ...], at least one")
        answers, parts, size = [], [], 0
        for vlog, vseg in vsegs:
            if size >= INDEX_ANSWER:
                answers.append({"later": True})
                continue
            try:
                mine = await self._index(self.store.get((broker, vlog, vseg)))
            except KeraError as e:
                answers.append({"error": e.code, "message": str(e)})
                continue
            n = sum(len(p) for p in mine)
            if size + n > limits.MAX_PAYLOAD:
                answers.append({"later": True} if size else
                               {"error": BackupError.code, "message": f"index of vseg {vseg} is too large"})
                continue
            answers.append({"rows": len(mine[0]), "bytes": n})
            parts += mine
            size += n
            self.counters["indexes"] = self.counters.get("indexes", 0) + 1
        return {"answers": answers}, parts

    async def _index(self, rep: Replica) -> list:
        """One replica's index: its rows, then its index chunks. The headers are gathered with
        one fancy index (from the mapped file, then from memory) and checked as arrays."""
        if not rep.closed or rep.corrupt or rep.damaged:
            raise BackupError(f"replica {rep.key} is not closed and intact; not indexed")
        starts = np.frombuffer(rep.starts, np.uint64).astype(np.int64)
        ends = np.frombuffer(rep.ends, np.uint64).astype(np.int64)
        cut = int(np.searchsorted(starts, rep.mem_base))  # chunks before it are read from the file
        packed = b""
        if cut:
            packed = await self._read_replica(rep, disk.read_headers, rep.path, starts[:cut])
        if cut < len(starts):
            memory = b"".join(rep.memory_parts(rep.mem_base, rep.length))
            packed += disk.gather_headers(memory, starts[cut:] - rep.mem_base)
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
        rows = np.column_stack((starts, ends - starts, h["stream_id"], h["streamlet"], h["group"],
                                h["segment"], h["offset"], h["producer_id"], h["sequence"], h["flags"]))
        marks = np.flatnonzero(h["flags"] & chunkfmt.INDEX)
        parts = [rows.astype("<u8").tobytes()]
        for s, e in zip(starts[marks].tolist(), ends[marks].tolist(), strict=True):  # one per adopted segment
            if s >= rep.mem_base:
                parts.append(b"".join(rep.memory_parts(s, e)))
                continue
            data, bad = await self._read_replica(rep, disk.read_verified, rep.path, s, e, [s], [e])
            if bad is not None:
                off, _, reason = self._corrupt(rep, bad)
                raise ChecksumError(f"replica {rep.key}: chunk at {off} is corrupt: {reason}")
            parts.append(data)
        return parts

    def rpc_read(self, meta: dict, payload):
        key = _key(meta)
        offset = _uint(meta, "offset", 0)
        max_bytes = min(max(_uint(meta, "max_bytes", DEFAULT_READ_BYTES), 1), MAX_READ_BYTES)
        rep, start, stop, corrupt_at, nxt, in_memory = self.store.plan_read(key, offset, max_bytes)
        self.counters["reads"] += 1
        if in_memory:
            parts = rep.memory_parts(start, stop) if stop > start else []
            self.counters["bytes_read"] += stop - start
            return BackupStore.read_meta(rep, nxt, corrupt_at), parts
        return self._read_file(rep, start, stop, corrupt_at, nxt)

    async def _read_replica(self, rep: Replica, fn, *args):
        """``fn(*args)`` in a worker thread, reading ``rep``'s file under the I/O lock: a
        replica dropped meanwhile, or an I/O error, is a ``BackupError``."""
        async with self._io:
            if rep.dropped:
                raise BackupError(f"replica {rep.key} was dropped")
            try:
                return await trio.to_thread.run_sync(fn, *args)
            except OSError as e:
                raise BackupError(f"reading replica {rep.key}: {e}") from None

    @staticmethod
    def _corrupt(rep: Replica, bad: tuple) -> tuple:
        """A chunk that failed verification on read: logged, marked, never served."""
        off, size, reason = bad
        log.error("replica %s: chunk at %d failed verification: %s; never served", rep.key, off, reason)
        rep.mark_corrupt(off, size, reason)
        return bad

    async def _read_file(self, rep: Replica, start: int, stop: int, corrupt_at, nxt):
        starts, ends = BackupStore.chunk_bounds(rep, start, stop)
        data, bad = await self._read_replica(rep, disk.read_verified, rep.path, start, stop, starts, ends)
        if bad is not None:
            off, size, _ = self._corrupt(rep, bad)
            corrupt_at, nxt = off, off + size
        self.counters["bytes_read"] += len(data)
        return BackupStore.read_meta(rep, nxt, corrupt_at), data

    async def rpc_claim(self, meta: dict, payload):
        """``owner`` (broker, ``epoch``) reads the listed vseg files of dead incarnations
        (``claims``: [[broker, vlog, vseg], ...]): they outlive their recovery's drop until
        released. Recorded before the answer; ``held``: per file, whether it is here."""
        owner = (_uint(meta, "owner"), _uint(meta, "epoch"))
        keys = self._claim_keys(meta)
        if owner[1] < self.store.broker_epochs.get(owner[0], 0):
            raise Fenced(f"broker {owner[0]} epoch {owner[1]} is fenced; it claims nothing")
        held, changed = self.claims.claim(owner, keys, self._whole)
        self.counters["claims"] += 1
        if changed:
            await self._save_claims()
        return {"held": held}

    def _whole(self, key) -> bool:
        """A file an adopted segment can read from: here, closed, nothing corrupt in it."""
        rep = self.store.replicas.get(key)
        return rep is not None and rep.closed and not rep.corrupt and not rep.damaged

    async def rpc_release(self, meta: dict, payload):
        """``owner`` no longer reads ``claims`` (all its claims if absent): a dropped file no
        claim holds any more is deleted."""
        owner = (_uint(meta, "owner"), _uint(meta, "epoch"))
        keys = self._claim_keys(meta) if meta.get("claims") is not None else None
        _, changed = self.claims.release(owner, keys)
        self.counters["releases"] += 1
        if changed:
            await self._save_claims()
        return {"bytes": await self._delete_unclaimed()}

    @staticmethod
    def _claim_keys(meta: dict) -> list[Key]:
        keys = meta.get("claims")
        if not isinstance(keys, list) or not all(
                isinstance(k, list) and len(k) == 3 and all(type(x) is int and 0 <= x < _U63 for x in k)
                for k in keys):
            raise InvalidArgument("claims must be [[broker, vlog, vseg], ...]")
        return [tuple(k) for k in keys]

    async def let_go(self, incarnations) -> dict:
        """The coordinator recovered these dead incarnations ([[broker, epoch], ...]) with
        nothing lost (``kera.recovered``): every file of theirs here is deleted, or only marked
        dropped while an owner claims it, and every claim they made is released. Idempotent."""
        if not isinstance(incarnations, list) or not all(
                isinstance(i, list) and len(i) == 2 and all(type(x) is int and 0 <= x < _U63 for x in i)
                for i in incarnations):
            raise InvalidArgument("recovered incarnations must be [[broker, epoch], ...]")
        dead = {(b, e) for b, e in incarnations}
        if not dead:
            return {"dropped": 0, "claimed": 0, "bytes": 0}
        keys = [k for k in self.store.replicas if (k[0], k[1] >> 32) in dead]  # vlog ids carry the epoch
        # all decided before any await: a claim arriving meanwhile finds the file gone
        claimed = {k for k in keys if self.claims.drop(k)}
        reps = [self.store.drop(k) for k in keys if k not in claimed]
        released = self.claims.release_owners(dead)
        if claimed or released:
            await self._save_claims()
        if reps:
            if self._kick is not None:
                self._kick.set()  # wake durability waiters so they see it
            self.counters["drops"] += len(reps)
            await self._unlink(reps)
        freed = await self._delete_unclaimed()
        if reps or freed:
            log.info("let go of recovered incarnations %s: %d files deleted, %d kept for their claims, "
                     "%d bytes of files they claimed freed", sorted(dead), len(reps), len(claimed), freed)
        return {"dropped": len(reps), "claimed": len(claimed), "bytes": freed}

    async def _unlink(self, reps: list[Replica]) -> None:
        """Delete the files of replicas already dropped from the store, in one thread hop."""
        def work():
            for rep in reps:
                disk.unlink_quiet(rep.path)
        try:
            with trio.CancelScope(shield=True):
                async with self._io:
                    await trio.to_thread.run_sync(work)
        except OSError as e:
            raise BackupError(f"dropping replicas {[r.key for r in reps]}: {e}") from None
        finally:
            for rep in reps:
                self.store.dropped(rep)

    # -- fencing and recovery ------------------------------------------------

    def apply_fences(self, fences) -> None:
        self.store.apply_fences(fences)

    def rpc_fence(self, meta: dict, payload):
        self.store.apply_fences({_uint(meta, "broker"): _uint(meta, "epoch")})
        return {}

    async def rpc_replay(self, meta: dict, payload):
        """Push one replica's chunks, from ``offset``, to the brokers recovering their streamlets.

        Stops at the copy's end or at its first corrupt chunk and says where
        (``next``, ``stopped``), so that another copy takes over from there.
        """
        key = _key(meta)
        rep = self.store.get(key)
        routes = parse_routes(meta.get("routes"))
        offset = _uint(meta, "offset", 0)
        if offset > rep.length:
            raise InvalidArgument(f"offset {offset} beyond replica {key} of length {rep.length}")

        async def read(offset, max_bytes):
            res = self.rpc_read({"broker": key[0], "vlog": key[1], "vseg": key[2], "offset": offset,
                                 "max_bytes": max_bytes}, b"")
            return await res if inspect.iscoroutine(res) else res

        out = await replay(read, self.pool, routes, offset, rep.length,
                           parse_replay_from(meta.get("replay_from")))
        log.info("replayed replica %s from %d: %s", key, offset, out)
        return out

    def rpc_stats(self, meta: dict, payload):
        s = self.store
        return {"backup": self.id, **self.counters, "segments": len(s.replicas),
                "memory_bytes": s.memory, "unflushed_bytes": s.unflushed,
                "disk_bytes": s.committed, "disk_error": s.disk_error, "reclaimed_bytes": s.reclaimed,
                "claimed_files": len(self.claims.owners)}


# -- command line ----------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kera backup", description="Run a kera backup service.")
    p.add_argument("--dir", required=True, help="data directory (segment files, backup.id)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--coordinator", default=os.environ.get("KERA_COORDINATOR"),
                   help="HOST:PORT[,HOST:PORT...] of the coordinators to register with")
    p.add_argument("--node", help="node name (backups and brokers of one node share it)")
    p.add_argument("--fsync", choices=("periodic", "write", "always"), default="write",
                   help="when a replicate is answered: periodic (in memory), write (written to the "
                        "file, survives a killed process; default) or always (fsynced)")
    p.add_argument("--flush-interval", type=float, default=0.05, metavar="SECONDS")
    p.add_argument("--fsync-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--max-bytes", type=int, default=0, help="limit on segment files in DIR (0: none)")
    p.add_argument("--max-memory", type=int, default=DEFAULT_MAX_MEMORY,
                   help="limit on accepted bytes not yet written to disk")
    p.add_argument("--log-level", default="INFO")
    return p


async def _main(args) -> bool:
    svc = BackupService(args.dir, fsync=args.fsync, flush_interval=args.flush_interval,
                        fsync_interval=args.fsync_interval, max_bytes=args.max_bytes,
                        max_memory=args.max_memory, coordinator=args.coordinator, node=args.node)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(svc.run, args.host, args.port)
            print(f"backup {svc.id if svc.id is not None else '-'} listening on {args.host}:{port}",
                  flush=True)
            async for sig in signals:
                log.info("signal %d: flushing and exiting", sig)
                svc.stop()
                break
    return not svc.store.dirty


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.makedirs(args.dir, exist_ok=True)
    return 0 if trio.run(_main, args) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
