"""BackupService: stores replicas of brokers' virtual segments, flushes them to disk.

The service is the backup's RPC face and its life (reload, serve, stop with everything
written); the work is done by parts that each own their state and are handed what they
need of the others:

- ``store`` (``kera.backup.store.BackupStore``): the decisions, sans-IO: which replicate
  is stored, acknowledged again or refused, budgets, what a flush writes, reads, drops;
- ``flusher`` (``kera.backup.flushing``): the file work under one I/O lock: files made,
  written and fsynced in rounds, deleted;
- ``intake`` (``kera.backup.intake``): the replicate path, answered once the bytes are
  where ``--fsync`` wants them;
- ``readback`` (``kera.backup.readback``): reads for recovery (read, replay, index) and
  for evicted segments (read_chunks);
- ``release`` (``kera.backup.release``): trims, claims and let-go: which files are
  deleted, and when;
- ``scrubber`` (``kera.backup.scrub``): every chunk on disk read back and verified again.

The command line is ``kera.backup.main``.
"""

from __future__ import annotations

import logging
import os

import trio

from .. import wire
from ..coordinator.link import CoordinatorLink
from ..door import Door
from ..errors import InvalidArgument
from ..rpc import advertised, open_pool
from ..security.credentials import Credentials
from ..security.gate import Gate, take_state
from ..security.mechanisms import BACKUP
from ..server import Service
from ..wire.columns import PLAIN_COLUMNS
from . import disk
from .flushing import Flusher
from .intake import Intake
from .membership import load_id, run_membership
from .readback import ReadBack
from .release import Release
from .replica import Replica
from .scrub import DEFAULT_EVERY, DEFAULT_RATE, Scrubber
from .store import DEFAULT_MAX_MEMORY, BackupStore

log = logging.getLogger("kera.backup")

SEGMENTS_DIR = "segments"
COUNTERS = ("replicate_rpcs", "replicate_entries", "chunks", "bytes_received", "duplicates",
            "bytes_flushed", "fsyncs", "errors", "write_errors", "reads", "bytes_read", "drops",
            "trims", "tiered_reads", "tiered_bytes", "claims", "releases", "scrubbed_bytes",
            "scrub_passes", "damage", "verified_bytes")


class BackupService(Service):
    rpcs = wire.BACKUP_RPCS

    def __init__(self, directory: str, *, fsync: str = "periodic", flush_interval: float = 0.05,
                 fsync_interval: float = 1.0, max_bytes: int = 0, max_memory: int = DEFAULT_MAX_MEMORY,
                 coordinator: str | None = None, node: str | None = None,
                 scrub_rate: int = DEFAULT_RATE, scrub_every: float = DEFAULT_EVERY,
                 cluster_secret: bytes, auth: bool = False, door: Door | None = None,
                 tls=(None, None), advertise: str = ""):
        if fsync not in ("periodic", "write", "always"):
            raise ValueError("fsync must be 'periodic', 'write' or 'always'")
        if flush_interval <= 0 or fsync_interval <= 0 or max_bytes < 0 or max_memory <= 0:
            raise ValueError("intervals and max_memory must be > 0, max_bytes >= 0")
        if scrub_rate < 0 or scrub_every < 0:
            raise ValueError("scrub_rate and scrub_every must be >= 0 (a rate of 0: no scrubbing)")
        self.dir = directory
        self.segdir = os.path.join(directory, SEGMENTS_DIR)
        self.coordinator = coordinator
        self.node = node
        self.advertise = advertise   # HOST[:PORT] brokers reach us at (default: the bound host and port)
        self.addr = ""
        self.id: int | None = load_id(directory) if os.path.isdir(directory) else None
        self.gate = Gate(cluster_secret, auth=auth)
        self.door = door or Door()
        # what this backup's connections present to the others: a backup, as itself
        self.credentials = Credentials.member(cluster_secret, BACKUP, self.id, tls=tls[1])
        self.tls = tls[0]   # the listener's TLS context (None: plaintext)
        self.epoch: int | None = None
        self.port: int | None = None
        self.pool = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.metrics = None   # kera.metrics.backup, with --metrics-port
        self.registered: trio.Event | None = None
        self._stop: trio.Event | None = None
        # the parts
        self.store = BackupStore(self.segdir, max_bytes=max_bytes, max_memory=max_memory)
        self.flusher = Flusher(self.store, self.counters, self.segdir, fsync=fsync,
                               flush_interval=flush_interval, fsync_interval=fsync_interval,
                               timed=self._fsync_timed)
        self.intake = Intake(self.store, self.counters, self.flusher)
        self.readback = ReadBack(self.store, self.counters, lambda: self.pool)
        self.release = Release(self.store, self.counters, directory, self.flusher)
        self.scrubber = Scrubber(self.store, self.counters, self.readback, rate=scrub_rate,
                                 every=scrub_every)

    def _fsync_timed(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.fsync.observe(seconds)

    # -- lifecycle -----------------------------------------------------------

    async def run(self, host: str = "127.0.0.1", port: int = 0, *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Reload DIR, serve, flush; returns after ``stop()`` with everything fsynced."""
        self._stop, self.registered = trio.Event(), trio.Event()
        await self.reload()
        async with open_pool(credentials=self.credentials) as pool, trio.open_nursery() as nursery:
            self.pool = pool
            self.port = await nursery.start(self.serve, host, port)
            self.addr = advertised(host, self.port, self.advertise)
            nursery.start_soon(self.flusher.flusher)
            if not self.flusher.always:
                nursery.start_soon(self.flusher.syncer)
            if self.scrubber.rate:
                nursery.start_soon(self.scrubber.run)
            if self.coordinator:
                nursery.start_soon(run_membership, self, CoordinatorLink(pool, self.coordinator),
                                   self.addr, self.node)
            task_status.started(self.port)
            await self._stop.wait()
            with trio.CancelScope(shield=True):
                await self._final_flush()
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        self._stop.set()

    async def _final_flush(self) -> None:
        """Refuse new data, then write and fsync everything accepted (trailers too)."""
        self.intake.stopping = True
        dirty = self.store.dirty
        for _ in range(50):  # a file still being created gets the io lock between rounds
            await self.flusher.flush_round(fsync=True)
            if all(rep.error for rep in dirty):
                break
        if dirty:
            log.error("exiting with %d replicas not fully on disk (%d bytes)", len(dirty),
                      self.store.unflushed)
        else:
            log.info("all replicas flushed and fsynced")

    async def reload(self) -> None:
        """Load every segment file: verify all chunks, cut torn tails, report corruption; then
        the floors and claims, and what was due to go before a restart."""
        loaded = await trio.to_thread.run_sync(disk.load_dir, self.segdir)
        for ld, key in loaded:
            rep = Replica.from_loaded(ld, key)
            rep.ready = trio.Event()
            rep.ready.set()
            self.store.load(rep, ld.file_size)
        if loaded:
            log.info("reloaded %d segment files (%d bytes)", len(loaded), self.store.committed)
        await self.release.load()

    # -- what membership reads and tells (kera.backup.membership) -------------------------
    def holds(self) -> list[list]:
        return self.store.holds()

    def apply_fences(self, fences) -> None:
        self.store.apply_fences(fences)

    async def let_go(self, incarnations) -> dict:
        return await self.release.let_go(incarnations)

    # -- the RPCs ------------------------------------------------------------------------
    def rpc_replicate(self, meta: dict, payload):
        return self.intake.replicate(meta, payload)

    def rpc_read_chunks(self, meta: dict, payload):
        return self.readback.read_chunks(meta)

    def rpc_index(self, meta: dict, payload):
        return self.readback.index(meta)

    def rpc_read(self, meta: dict, payload):
        return self.readback.read(meta)

    def rpc_replay(self, meta: dict, payload):
        return self.readback.replay(meta, payload)

    def rpc_trim(self, meta: dict, payload):
        return self.release.trim(meta)

    def rpc_claim(self, meta: dict, payload):
        return self.release.claim(meta)

    def rpc_release(self, meta: dict, payload):
        return self.release.release(meta)

    def rpc_list(self, meta: dict, payload):
        """Replicas held (``broker``'s, or all) and vlog floors; with ``columns``, the closed,
        intact ones as rows of ``PLAIN_COLUMNS`` u64s in the payload (``plain``: how many)."""
        b = meta.get("broker")
        out = {"backup": self.id, "floors": self.store.floor_list(b)}
        if meta.get("columns"):
            if b is None:
                raise InvalidArgument("list with columns names a broker")
            out["segments"], rows = self.store.listing_columns(b)
            out["plain"] = len(rows) // (8 * PLAIN_COLUMNS)
            return out, rows
        out["segments"] = self.store.listing(b)
        return out

    def rpc_fence(self, meta: dict, payload):
        self.store.apply_fences({meta["broker"]: meta["epoch"]})
        return {}

    def rpc_security(self, meta: dict, payload):
        """The users and ACLs, pushed by the coordinator when they change."""
        return take_state(self.gate, meta)

    def rpc_stats(self, meta: dict, payload):
        s = self.store
        return {"backup": self.id, **self.counters, "segments": len(s.replicas),
                "memory_bytes": s.memory, "unflushed_bytes": s.unflushed,
                "disk_bytes": s.committed, "disk_error": s.disk_error, "reclaimed_bytes": s.reclaimed,
                "claimed_files": len(self.release.claims.owners), "door": self.door.describe()}

