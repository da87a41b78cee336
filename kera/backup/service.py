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
import uuid
from array import array
from bisect import bisect_left

import trio

from .. import chunk as chunkfmt
from .. import limits
from ..errors import BackupError, ChecksumError, Fenced, InvalidArgument, KeraError, ProtocolError
from ..rpc import Service, open_pool
from . import segment_file
from .membership import load_id, run_membership
from .replay import parse_routes, replay
from .replica import Replica

log = logging.getLogger("kera.backup")

SEGMENTS_DIR = "segments"
MAX_REPLICATE_BYTES = limits.MAX_REPLICATE_PAYLOAD  # one replicate payload
MAX_READ_BYTES = limits.MAX_READ                    # one read reply (unless a single chunk is larger)
DEFAULT_READ_BYTES = 1 << 20
MAX_SEGMENT_BYTES = limits.MAX_REPLICA_BYTES        # one replica's chunk area
MAX_REPLICAS = 100_000           # replicas held at once
DEFAULT_MAX_MEMORY = 1 << 30     # unflushed bytes; flushed ones are released under pressure
_U63 = 1 << 63

Key = tuple[int, int, int]


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


def _verify(mv: memoryview) -> list:
    try:
        return chunkfmt.scan(mv)
    except ChecksumError as e:
        raise ChecksumError(f"replicate payload: {e}; nothing stored") from None
    except ProtocolError as e:
        raise InvalidArgument(f"replicate payload is not whole valid chunks: {e}; nothing stored") from None


def _length_error(msg: str, length: int) -> BackupError:
    """An offset the replica cannot take: the broker resends from ``length``."""
    err = BackupError(f"{msg}; length={length}")
    err.length = length  # crosses the wire once KeraError.to_wire sends extra attributes
    return err


def _read_verified(path: str, start: int, stop: int, starts: list[int], ends: list[int]):
    """Read [start, stop) from the file, verifying each chunk again (disks rot).

    Returns (data, bad) where bad is None or (offset, size, reason) of the first
    chunk that failed; data then holds only the chunks before it.
    """
    data = segment_file.read(path, start, stop - start)
    for s, e in zip(starts, ends, strict=True):
        try:
            h = chunkfmt.verify(data, s - start)
            if h.size != e - s:
                raise ProtocolError("chunk size changed on disk")
        except (ChecksumError, ProtocolError) as err:
            return data[:s - start], (s, e - s, f"read back: {err}")
    return data, None


def _flush_jobs(jobs, segdir: str, dir_sync: bool, probe: bool):
    """Thread side of a flush round: all file I/O, no shared state touched."""
    results = []
    for path, start, parts, trailer, sync in jobs:
        try:
            segment_file.write(path, start, parts, trailer, sync)
            results.append(None)
        except OSError as e:
            results.append(e)
    extra = None
    try:
        if dir_sync:
            segment_file.fsync_dir(segdir)
        if probe:  # the disk failed earlier and nothing is pending: can we write again?
            p = os.path.join(segdir, f".probe-{uuid.uuid4().hex}")
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, b"probe")
            finally:
                os.close(fd)
                os.unlink(p)
    except OSError as e:
        extra = e
    return results, extra


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
        self.max_bytes = max_bytes
        self.max_memory = max_memory
        self.coordinator = coordinator
        self.node = node
        self.id: int | None = load_id(directory) if os.path.isdir(directory) else None
        self.epoch: int | None = None
        self.port: int | None = None
        self.replicas: dict[Key, Replica] = {}
        self._dropping: dict[Key, Replica] = {}
        self._dirty: dict[Replica, None] = {}   # insertion-ordered set
        self.broker_epochs: dict[int, int] = {}
        self.disk_error: str | None = None
        self.committed = 0    # bytes the segment files will take (checked against max_bytes)
        self.unflushed = 0    # accepted bytes not yet written
        self.memory = 0       # payload bytes held in memory
        self._dir_dirty = False
        self.stopping = False
        self.counters = dict.fromkeys(
            ("replicate_rpcs", "chunks", "bytes_received", "duplicates", "bytes_flushed", "fsyncs",
             "errors", "write_errors", "reads", "bytes_read", "drops"), 0)
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
        await self.reload()
        async with open_pool() as pool, trio.open_nursery() as nursery:
            self.pool = pool
            self.port = await nursery.start(self.serve, host, port)
            nursery.start_soon(self._flusher)
            if self.coordinator:
                adv = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
                nursery.start_soon(run_membership, self, pool, self.coordinator, f"{adv}:{self.port}",
                                   self.node)
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
        for _ in range(50):  # a file still being created gets the io lock between rounds
            await self._flush_round(fsync=True)
            if all(rep.error for rep in self._dirty):
                break
        if self._dirty:
            log.error("exiting with %d replicas not fully on disk (%d bytes)", len(self._dirty),
                      self.unflushed)
        else:
            log.info("all replicas flushed and fsynced")

    async def reload(self) -> None:
        """Load every segment file: verify all chunks, cut torn tails, report corruption."""
        loaded = await trio.to_thread.run_sync(self._load_all)
        for ld, key in loaded:
            rep = Replica.from_loaded(ld, key)
            rep.ready = trio.Event()
            rep.ready.set()
            rep.budget = ld.file_size
            self.committed += rep.budget
            self.replicas[key] = rep
            self.broker_epochs[key[0]] = max(self.broker_epochs.get(key[0], 0), rep.epoch)
        if loaded:
            log.info("reloaded %d segment files (%d bytes)", len(loaded), self.committed)

    def _load_all(self) -> list:
        os.makedirs(self.segdir, exist_ok=True)
        out, seen = [], {}
        for name in sorted(os.listdir(self.segdir)):
            path = os.path.join(self.segdir, name)
            if name.startswith(".probe-"):
                os.unlink(path)
                continue
            key = segment_file.parse_name(name)
            if key is None:
                log.warning("ignoring %s: not a segment file name", path)
                continue
            ld = segment_file.load(path, repair=True)
            if ld.header is None and ld.scan is None and ld.file_size == 0:
                log.warning("%s: %s; removed", path, ld.error)
                continue
            if ld.header is not None:
                hkey = (ld.header.broker, ld.header.vlog, ld.header.vseg)
                if hkey != key:
                    log.warning("%s holds segment %s per its header; using that", path, hkey)
                    key = hkey
            if key in seen:
                log.error("%s: segment %s is also in %s; ignored (kept on disk)", path, key, seen[key])
                continue
            seen[key] = path
            if ld.error:
                log.error("%s: %s; kept, not served", path, ld.error)
            if ld.cut_bytes:
                log.warning("%s: torn tail of %d bytes cut", path, ld.cut_bytes)
            if ld.scan is not None:
                for c in ld.scan.corrupt:
                    log.error("%s: corrupt at offset %d (%d bytes): %s; never served",
                              path, c["offset"], c["length"], c["reason"])
            out.append((ld, key))
        return out

    def holds(self) -> list[list]:
        return [[b, v, s, r.length, r.closed] for (b, v, s), r in sorted(self.replicas.items())]

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
        mv = _stable(payload)
        n = mv.nbytes
        if n > MAX_REPLICATE_BYTES:
            raise InvalidArgument(f"replicate payload of {n} bytes exceeds {MAX_REPLICATE_BYTES}")
        known = self.broker_epochs.get(key[0], 0)
        if epoch < known:
            raise Fenced(f"broker {key[0]} epoch {epoch} is older than {known}")
        rep = self.replicas.get(key)
        if rep is None:
            if offset != 0:
                raise _length_error(f"no replica {key} here, offset {offset}", 0)
            if n == 0 and not close:
                return {"length": 0}
            if key in self._dropping:
                raise BackupError(f"replica {key} is being dropped; retry")
            if self.disk_error:
                raise BackupError(f"disk failing, no new segment accepted: {self.disk_error}")
            if len(self.replicas) >= MAX_REPLICAS:
                raise BackupError(f"backup holds {MAX_REPLICAS} replicas already")
            base = 0
        else:
            if rep.error:
                raise BackupError(f"replica {key}: {rep.error}")
            end = offset + n
            if end <= rep.length:
                if not close or rep.closed:
                    self.counters["duplicates"] += 1
                    return self._ack(rep, end, close)
                if end != rep.length:
                    raise _length_error(f"close of {key} at {end}", rep.length)
                mv, n = mv[:0], 0  # the bytes are a resend, only the close is new
            elif offset != rep.length:
                raise _length_error(f"replica {key}: offset {offset} is not its end", rep.length)
            if rep.damaged:
                raise BackupError(f"replica {key} is damaged on disk; it takes no appends")
            if rep.closed:
                raise BackupError(f"replica {key} is closed; length={rep.length}")
            base = rep.length
        chunks = _verify(mv) if n else []
        if base + n > MAX_SEGMENT_BYTES:
            raise BackupError(f"replica {key} would exceed {MAX_SEGMENT_BYTES} bytes")
        need = n + (segment_file.FILE_HEADER_SIZE if rep is None else 0) \
            + (segment_file.TRAILER_SIZE if close else 0)
        if self.max_bytes and self.committed + need > self.max_bytes:
            raise BackupError(f"backup full: {self.committed} + {need} bytes exceeds --max-bytes "
                              f"{self.max_bytes}; nothing stored")
        if self.unflushed + n > self.max_memory:
            raise BackupError(f"backup memory full ({self.unflushed} bytes not yet on disk); retry")
        # accepted: nothing below raises
        new = rep is None
        if new:
            rep = Replica(*key, epoch, os.path.join(self.segdir, segment_file.file_name(*key)))
            rep.ready = trio.Event()
            self.replicas[key] = rep
        self.broker_epochs[key[0]] = max(known, epoch)
        if n:
            rep.append(mv, chunks)
            self.unflushed += n
            self.memory += n
            self.counters["chunks"] += len(chunks)
            self.counters["bytes_received"] += n
        if close:
            rep.closed = True
        self.committed += need
        rep.budget += need
        self._dirty[rep] = None
        if new:
            return self._first_replicate(rep, rep.length, close)
        return self._ack(rep, rep.length, close)

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
                self.disk_error = rep.failed
                self.counters["write_errors"] += 1
            self._forget(rep)
        finally:
            rep.ready.set()

    def _forget(self, rep: Replica) -> None:
        """Take a replica out of service (dropped, or its file could not be made)."""
        if rep.dropped:
            return
        rep.dropped = True
        if self.replicas.get(rep.key) is rep:
            del self.replicas[rep.key]
        self._dirty.pop(rep, None)
        self.committed -= rep.budget
        self.unflushed -= rep.length - rep.flushed
        self.memory -= rep.memory_bytes
        rep.blocks, rep.block_starts = [], array("Q")
        if self._kick is not None:
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
        """Write every dirty replica's new bytes (and trailers), fsync if asked."""
        async with self._io:
            jobs = []
            for rep in list(self._dirty):
                if not rep.created:
                    continue  # its first replicate is creating the file
                upto = rep.length
                parts = rep.memory_parts(rep.flushed, upto) if rep.flushed < upto else []
                trailer = segment_file.encode_trailer(upto, rep.chunks + len(rep.corrupt)) \
                    if rep.closed and not rep.trailer_written else None
                sync = fsync and (rep.synced < upto or (rep.closed and not rep.trailer_synced))
                if not parts and trailer is None and not sync:
                    if rep.clean:
                        self._dirty.pop(rep, None)
                    continue
                jobs.append((rep, rep.flushed, upto, parts, trailer, sync))
            dir_sync = fsync and self._dir_dirty
            probe = self.disk_error is not None and not jobs
            if not (jobs or dir_sync or probe):
                return
            results, extra = await trio.to_thread.run_sync(
                _flush_jobs, [(r.path, s, p, t, y) for r, s, _, p, t, y in jobs], self.segdir,
                dir_sync, probe)
        ok = False
        for (rep, start, upto, _parts, trailer, sync), err in zip(jobs, results, strict=True):
            if rep.dropped:
                continue
            if err is not None:
                msg = f"writing {os.path.basename(rep.path)} failed: {err}"
                if rep.error != msg:
                    log.error("replica %s: %s", rep.key, msg)
                    self.counters["write_errors"] += 1
                rep.error = msg
                self.disk_error = msg
                continue
            ok = True
            rep.flushed = upto
            self.unflushed -= upto - start
            self.counters["bytes_flushed"] += upto - start
            if trailer is not None:
                rep.trailer_written = True
            if sync:
                rep.synced = upto
                rep.trailer_synced = rep.trailer_written
                self.counters["fsyncs"] += 1
            if rep.error:
                log.info("replica %s: written again after failure", rep.key)
                rep.error = None
            if rep.clean:
                self._dirty.pop(rep, None)
                if rep.closed:
                    self.memory -= rep.release(rep.length)
        if extra is not None:
            if dir_sync or self.disk_error is None:
                log.error("segment directory: %s", extra)
            self.disk_error = f"segment directory: {extra}"
        else:
            if dir_sync:
                self._dir_dirty = False
            if ok or probe:
                self.disk_error = None
        if self.memory > self.max_memory:  # pressure: forget what the files hold
            for rep in self.replicas.values():
                if rep.synced > rep.mem_base:
                    self.memory -= rep.release(rep.synced)

    # -- list / read / drop / stats ------------------------------------------

    def rpc_list(self, meta: dict, payload):
        broker = meta.get("broker")
        reps = sorted(self.replicas.items())
        return {"backup": self.id, "segments": [r.info() for k, r in reps if broker is None or k[0] == broker]}

    def rpc_read(self, meta: dict, payload):
        key = _key(meta)
        offset = _uint(meta, "offset", 0)
        max_bytes = min(max(_uint(meta, "max_bytes", DEFAULT_READ_BYTES), 1), MAX_READ_BYTES)
        rep = self.replicas.get(key)
        if rep is None:
            raise BackupError(f"no replica {key} here")
        start, stop, corrupt_at, nxt = rep.plan_read(offset, max_bytes)
        self.counters["reads"] += 1
        if start == stop or start >= rep.mem_base:
            parts = rep.memory_parts(start, stop) if stop > start else []
            self.counters["bytes_read"] += stop - start
            return self._read_meta(rep, nxt, corrupt_at), parts
        return self._read_file(rep, start, stop, corrupt_at, nxt)

    def _read_meta(self, rep: Replica, nxt: int, corrupt_at: int | None) -> dict:
        out = {"length": rep.length, "next": nxt, "end": nxt >= rep.length, "closed": rep.closed}
        if corrupt_at is not None:
            out["corrupt_at"] = corrupt_at
        return out

    async def _read_file(self, rep: Replica, start: int, stop: int, corrupt_at, nxt):
        i = bisect_left(rep.starts, start)
        j = bisect_left(rep.ends, stop, i)
        assert rep.starts[i] == start and rep.ends[j] == stop
        async with self._io:
            if rep.dropped:
                raise BackupError(f"replica {rep.key} was dropped")
            try:
                data, bad = await trio.to_thread.run_sync(
                    _read_verified, rep.path, start, stop, rep.starts[i:j + 1].tolist(),
                    rep.ends[i:j + 1].tolist())
            except OSError as e:
                raise BackupError(f"reading replica {rep.key}: {e}") from None
        if bad is not None:
            off, size, reason = bad
            log.error("replica %s: chunk at %d failed verification: %s; never served", rep.key, off, reason)
            rep.mark_corrupt(off, size, reason)
            corrupt_at, nxt = off, off + size
        self.counters["bytes_read"] += len(data)
        return self._read_meta(rep, nxt, corrupt_at), data

    def rpc_drop(self, meta: dict, payload):
        key = _key(meta)
        rep = self.replicas.get(key)
        if rep is None:
            return {"dropped": False}
        self._forget(rep)
        self._dropping[key] = rep
        self.counters["drops"] += 1
        return self._unlink(rep)

    async def _unlink(self, rep: Replica):
        try:
            with trio.CancelScope(shield=True):
                async with self._io:
                    await trio.to_thread.run_sync(_unlink_quiet, rep.path)
        except OSError as e:
            raise BackupError(f"dropping replica {rep.key}: {e}") from None
        finally:
            if self._dropping.get(rep.key) is rep:
                del self._dropping[rep.key]
        return {"dropped": True}

    # -- fencing and recovery ------------------------------------------------

    def apply_fences(self, fences) -> None:
        """Brokers' epochs the coordinator fenced: their replicas are refused from now on."""
        for b, e in (fences or {}).items():
            self.broker_epochs[int(b)] = max(self.broker_epochs.get(int(b), 0), int(e) + 1)

    def rpc_fence(self, meta: dict, payload):
        self.apply_fences({_uint(meta, "broker"): _uint(meta, "epoch")})
        return {}

    async def rpc_replay(self, meta: dict, payload):
        """Push one replica's chunks, from ``offset``, to the brokers recovering their streamlets.

        Stops at the copy's end or at its first corrupt chunk and says where
        (``next``, ``stopped``), so that another copy takes over from there.
        """
        key = _key(meta)
        rep = self.replicas.get(key)
        if rep is None:
            raise BackupError(f"no replica {key} here")
        routes = parse_routes(meta.get("routes"))
        offset = _uint(meta, "offset", 0)
        if offset > rep.length:
            raise InvalidArgument(f"offset {offset} beyond replica {key} of length {rep.length}")

        async def read(offset, max_bytes):
            res = self.rpc_read({"broker": key[0], "vlog": key[1], "vseg": key[2], "offset": offset,
                                 "max_bytes": max_bytes}, b"")
            return await res if inspect.iscoroutine(res) else res

        out = await replay(read, self.pool, routes, offset, rep.length)
        log.info("replayed replica %s from %d: %s", key, offset, out)
        return out

    def rpc_stats(self, meta: dict, payload):
        return {"backup": self.id, **self.counters, "segments": len(self.replicas),
                "memory_bytes": self.memory, "unflushed_bytes": self.unflushed,
                "disk_bytes": self.committed, "disk_error": self.disk_error}


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- command line ----------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kera backup", description="Run a kera backup service.")
    p.add_argument("--dir", required=True, help="data directory (segment files, backup.id)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--coordinator", help="HOST:PORT of the coordinator to register with")
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
    return not svc._dirty


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.makedirs(args.dir, exist_ok=True)
    return 0 if trio.run(_main, args) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
