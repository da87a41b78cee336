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
(``disk``).
"""

from __future__ import annotations

import logging
import os
import time

import trio

from . import disk
from .replica import Replica
from .store import FlushJob

log = logging.getLogger("kera.backup")

WRITE_NOW_BYTES = 64 << 10  # unwritten bytes a replicate writes itself (--fsync write)


class Flushing:
    """``BackupService``'s write and sync rounds (its state: store, io lock, kick and
    round-done events, fsync mode and intervals, counters)."""

    async def _flusher(self) -> None:
        """A write round every --flush-interval, or at once when a replicate waits for one
        (with --fsync always each round fsyncs what it wrote)."""
        while True:
            with trio.move_on_after(self.flush_interval):
                await self._kick.wait()
            self._kick = trio.Event()
            done, self._round_done = self._round_done, trio.Event()
            try:
                await self._flush_round(self.always)
            finally:
                done.set()

    async def _syncer(self) -> None:
        """--fsync periodic / write: every --fsync-interval, a sync round beside the flusher."""
        while True:
            await trio.sleep(self.fsync_interval)
            self._syncing = True
            try:
                await self._sync_round()
            finally:
                self._syncing = False

    async def _sync_round(self) -> None:
        """Fsync what earlier rounds wrote, in a task of its own and without the io lock, so
        write rounds (and the replicates waiting on them) go on meanwhile: an fsync after a
        large write takes tens of milliseconds, which every answer would otherwise wait."""
        due = self.store.sync_due()
        dir_sync = self._dir_dirty
        if not (due or dir_sync):
            return
        self._dir_dirty = False
        t0 = time.perf_counter()
        results, extra = await trio.to_thread.run_sync(
            disk.sync_round, [rep.path for rep, _, _ in due], self.segdir, dir_sync)
        if self.metrics is not None:
            self.metrics.fsync.observe(time.perf_counter() - t0)
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
            self._dir_dirty = True
            log.error("segment directory: %s", extra)
            store.disk_error = f"segment directory: {extra}"
        store.relieve_memory()

    async def _flush_round(self, fsync: bool) -> None:
        """Write what the store says is due (new bytes, trailers), fsync if asked, in a thread;
        report back."""
        async with self._io:
            work = self._round_work(fsync)
            if work is None:
                return
            t0 = time.perf_counter()
            done = await trio.to_thread.run_sync(disk.write_round, *work[1:])
            if fsync and self.metrics is not None:
                self.metrics.fsync.observe(time.perf_counter() - t0)
        self._round_outcome(work, *done)

    def _write_now(self) -> bool:
        """A write round (no fsync) right here, if little is due and no file work is under way
        (a round in a thread, a file created, read or deleted); False if not done."""
        if self.store.unflushed > WRITE_NOW_BYTES or self._syncing:
            return False   # (a write beside an fsync may block: not on the event loop)
        try:
            self._io.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            work = self._round_work(False)
            if work is not None:
                self._round_outcome(work, *disk.write_round(*work[1:]))
        finally:
            self._io.release()
        return True

    def _round_work(self, fsync: bool) -> tuple | None:
        """What is due (under the io lock): its jobs, then ``disk.write_round``'s arguments;
        None if nothing."""
        store = self.store
        jobs: list[FlushJob] = store.flush_jobs(fsync)
        dir_sync = fsync and self._dir_dirty
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
                self._dir_dirty = False
            if ok or probe:
                store.disk_error = None
        store.relieve_memory()
