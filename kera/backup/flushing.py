"""Writing replicas to their files: the backup's write rounds and sync rounds.

The flusher task runs a write round every ``--flush-interval``, or at once when
a replicate waits for one; with ``--fsync always`` each round also fsyncs what
it wrote (group commit). With ``--fsync periodic`` or ``write`` a syncer task
fsyncs what earlier rounds wrote every ``--fsync-interval``, beside the write
rounds and without the io lock: an fsync after a large write takes tens of
milliseconds, which every waiting replicate would otherwise wait too. With
``--fsync write`` a replicate that finds little unwritten (``WRITE_NOW_BYTES``)
and no file work under way writes the round itself, on the event loop
(``_write_now``). What each round writes is the store's decision
(``BackupStore.flush_jobs`` / ``sync_due``); the file work runs in threads
(``disk``). The ``Flusher`` holds the I/O lock every file change is made under (a
file created, written, deleted); reads of written bytes go beside it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import trio

from ..errors import BackupError
from . import disk, segment_file
from .replica import Replica
from .store import BackupStore, FlushJob

log = logging.getLogger("kera.backup")

WRITE_NOW_BYTES = 64 << 10  # unwritten bytes a replicate writes itself (--fsync write)


class Flusher:
    """The backup's file work: replicas' files created, written in rounds and fsynced, and
    deleted, one change at a time (the I/O lock). Handed the ``store`` (what is due), the
    service's ``counters``, the segment directory, the --fsync mode and intervals, and
    ``timed(seconds)``, told how long each fsync round took."""

    def __init__(self, store: BackupStore, counters: dict, segdir: str, *, fsync: str,
                 flush_interval: float, fsync_interval: float, timed: Callable[[float], None]):
        self.store, self.counters, self.segdir, self.timed = store, counters, segdir, timed
        self.always = fsync == "always"
        self.write_through = fsync == "write"  # written (not fsynced) before the ack
        self.flush_interval = flush_interval
        self.fsync_interval = fsync_interval
        self.dir_dirty = False   # a file was created or deleted since the directory's fsync
        self.syncing = False     # a sync round is under way (``syncer``)
        self.io = trio.Lock()
        self.kicked = trio.Event()       # a replicate waits for a round
        self.round_done = trio.Event()   # set when the round under way (or the next) ends

    def kick(self) -> None:
        """A round now, not at the next interval (a replicate waits, or a replica is gone)."""
        self.kicked.set()

    async def next_round(self) -> None:
        """Until a write round that begins after this call has ended."""
        done = self.round_done
        self.kicked.set()
        await done.wait()

    async def flusher(self) -> None:
        """A write round every --flush-interval, or at once when a replicate waits for one
        (with --fsync always each round fsyncs what it wrote)."""
        while True:
            with trio.move_on_after(self.flush_interval):
                await self.kicked.wait()
            self.kicked = trio.Event()
            done, self.round_done = self.round_done, trio.Event()
            try:
                await self.flush_round(self.always)
            finally:
                done.set()

    async def syncer(self) -> None:
        """--fsync periodic / write: every --fsync-interval, a sync round beside the flusher."""
        while True:
            await trio.sleep(self.fsync_interval)
            self.syncing = True
            try:
                await self._sync_round()
            finally:
                self.syncing = False

    async def _sync_round(self) -> None:
        """Fsync what earlier rounds wrote, in a task of its own and without the io lock, so
        write rounds (and the replicates waiting on them) go on meanwhile: an fsync after a
        large write takes tens of milliseconds, which every answer would otherwise wait."""
        due = self.store.sync_due()
        dir_sync = self.dir_dirty
        if not (due or dir_sync):
            return
        self.dir_dirty = False
        t0 = time.perf_counter()
        results, extra = await trio.to_thread.run_sync(
            disk.sync_round, [rep.path for rep, _, _ in due], self.segdir, dir_sync)
        self.timed(time.perf_counter() - t0)
        store = self.store
        for (rep, upto, trailer), err in zip(due, results, strict=True):
            if rep.dropped:
                continue
            if err is not None:
                self._disk_failed(rep, f"fsync of {os.path.basename(rep.path)} failed: {err}")
                continue
            store.sync_done(rep, upto, trailer)
            self.counters["fsyncs"] += 1
        if extra is not None:
            self.dir_dirty = True
            log.error("segment directory: %s", extra)
            store.disk_error = f"segment directory: {extra}"
        store.relieve_memory()

    async def flush_round(self, fsync: bool) -> None:
        """Write what the store says is due (new bytes, trailers), fsync if asked, in a thread;
        report back."""
        async with self.io:
            work = self._round_work(fsync)
            if work is None:
                return
            t0 = time.perf_counter()
            done = await trio.to_thread.run_sync(disk.write_round, *work[1:])
            if fsync:
                self.timed(time.perf_counter() - t0)
        self._round_outcome(work, *done)

    def write_now(self) -> bool:
        """A write round (no fsync) right here, if little is due and no file work is under way
        (a round in a thread, a file created, read or deleted); False if not done."""
        if self.store.unflushed > WRITE_NOW_BYTES or self.syncing:
            return False   # (a write beside an fsync may block: not on the event loop)
        try:
            self.io.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            work = self._round_work(False)
            if work is not None:
                self._round_outcome(work, *disk.write_round(*work[1:]))
        finally:
            self.io.release()
        return True

    def _round_work(self, fsync: bool) -> tuple | None:
        """What is due (under the io lock): its jobs, then ``disk.write_round``'s arguments;
        None if nothing."""
        store = self.store
        jobs: list[FlushJob] = store.flush_jobs(fsync)
        dir_sync = fsync and self.dir_dirty
        probe = store.disk_error is not None and not jobs
        if not (jobs or dir_sync or probe):
            return None
        return (jobs, [(j.replica.path, j.start, j.parts, j.trailer, j.sync) for j in jobs],
                self.segdir, dir_sync, probe)

    def _disk_failed(self, rep: Replica, msg: str) -> None:
        """A write or fsync of ``rep``'s file failed: reported to its next replicates, logged once."""
        if self.store.flush_failed(rep, msg):
            log.error("replica %s: %s", rep.key, msg)
            self.counters["write_errors"] += 1

    def _round_outcome(self, work: tuple, results: list, extra: OSError | None) -> None:
        """What a write round's outcome changes: replicas written or failed, the disk's state."""
        store = self.store
        jobs, _, _, dir_sync, probe = work
        ok = False
        for job, err in zip(jobs, results, strict=True):
            rep = job.replica
            if rep.dropped:
                continue
            if err is not None:
                self._disk_failed(rep, f"writing {os.path.basename(rep.path)} failed: {err}")
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
                self.dir_dirty = False
            if ok or probe:
                store.disk_error = None
        store.relieve_memory()

    # -- files made and deleted -----------------------------------------------------------
    async def create(self, rep: Replica) -> None:
        """``rep``'s file made (its header written); a failure is the replica's (its waiting
        replicates are told), and an I/O error the disk's."""
        try:
            async with self.io:
                if rep.dropped:
                    raise BackupError(f"replica {rep.key} was dropped")
                await trio.to_thread.run_sync(segment_file.create, rep.path, rep.broker, rep.vlog,
                                              rep.vseg, rep.epoch, self.always)
            rep.created = True
            self.dir_dirty = not self.always
        except (OSError, BackupError) as e:
            rep.failed = f"cannot create replica {rep.key}: {e}"
            if isinstance(e, OSError):
                log.error("%s", rep.failed)
                self.store.disk_error = rep.failed
                self.counters["write_errors"] += 1
            if self.store.forget(rep):
                self.kick()  # wake durability waiters so they see it
        finally:
            rep.ready.set()

    async def unlink(self, reps: list[Replica]) -> None:
        """Delete the files of replicas already dropped from the store, in one thread hop."""
        def work():
            for rep in reps:
                disk.unlink_quiet(rep.path)
        try:
            with trio.CancelScope(shield=True):
                async with self.io:
                    await trio.to_thread.run_sync(work)
        except OSError as e:
            raise BackupError(f"dropping replicas {[r.key for r in reps]}: {e}") from None
        finally:
            for rep in reps:
                self.store.dropped(rep)
