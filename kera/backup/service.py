"""BackupService: stores replicas of brokers' virtual segments, flushes them to disk.

A broker replicates each virtual segment of its virtual logs to R-1 backups
with ``replicate`` (one RPC carries the new chunks of every copy the broker
has for this backup, each at an explicit byte offset so a resend is
recognised); the backup verifies every chunk's checksums (one call
per chunk, never per record), keeps the payload in memory as it came, and
answers once the bytes are where ``--fsync`` wants them: in memory
(``periodic``), written to the segment file (``write``, the default) or
written and fsynced (``always``); ``flushing`` says how they get there.

Failures are never silent: a write error is remembered on its replica and
reported to the next replicate (periodic mode) or to the waiting one (always
mode); while the disk is failing no new segment is accepted; ``--max-bytes``
is checked before data is accepted, so a full disk refuses data up front.

What is accepted, written, read or dropped is decided by ``store.BackupStore``
(sans-IO, tested alone); this module takes the replicate RPCs and runs their
durability waits. Writing and fsyncing (the flusher, the syncer, a small round
written on the spot) is joined in from ``flushing``, reading replicas back
from ``readback``, deleting released ones (trims, claims, let-go) from
``release``.

Run: ``python -m kera.backup.service --dir DIR [--port 0] ...`` (the CLI's
``kera backup ...`` calls ``main(argv)``). When listening it prints one line
``backup <id> listening on HOST:PORT`` (``-`` while it has no id yet), the address it
advertises (``--advertise``, else ``--host`` and the port bound).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from bisect import bisect_left

import trio

from .. import door, metafile, metrics, wire
from ..coordinator.link import CoordinatorLink
from ..door import Door
from ..errors import BackupError, InvalidArgument, KeraError, LimitExceeded
from ..recovery.plan import PLAIN_COLUMNS
from ..rpc import advertised, open_pool
from ..security import secret as secret_
from ..security import tls as tls_
from ..security.credentials import Credentials
from ..security.gate import Gate, take_state
from ..security.mechanisms import BACKUP
from ..server import Service
from . import disk, segment_file
from .claims import Claims
from .fields import vseg_key
from .flushing import Flushing
from .membership import load_id, run_membership
from .readback import ReadBack
from .release import CLAIMS_FILE, FLOORS_FILE, Release
from .replica import Replica
from .scrub import DEFAULT_EVERY, DEFAULT_RATE, Scrubbing
from .store import DEFAULT_MAX_MEMORY, DUPLICATE, EMPTY, NEW, BackupStore, scan_payload
from .store import MAX_REPLICATE_BYTES as MAX_REPLICATE_BYTES  # the limits, named here too
from .store import MAX_SEGMENT_BYTES as MAX_SEGMENT_BYTES

log = logging.getLogger("kera.backup")

SEGMENTS_DIR = "segments"


def _stable(payload) -> memoryview:
    """The payload as a byte view that nobody can change (no copy if it is one)."""
    mv = memoryview(payload)
    if isinstance(mv.obj, bytes) and mv.c_contiguous:
        return mv.cast("B") if mv.format != "B" else mv
    return memoryview(bytes(mv))


def _scans(mv: memoryview, starts: list[int], sizes: list[int]) -> list:
    """The chunks of each entry (``sizes`` bytes at ``starts`` of ``mv``) from one scan of
    the whole payload: its per-call cost is paid once per RPC, not once per entry. All None
    (each entry is then verified alone, for its own error) unless the payload is whole valid
    chunks and every entry starts at one of them."""
    try:
        heads, offs = scan_payload(mv)
    except KeraError:
        return [None] * len(starts)
    out = []
    for st, sz in zip(starts, sizes, strict=True):
        if not sz:
            out.append(None)
            continue
        i = bisect_left(offs, st)
        if i == len(offs) or offs[i] != st:
            return [None] * len(starts)
        j = bisect_left(offs, st + sz, i)
        out.append((heads[i:j], [o - st for o in offs[i:j]]))
    return out


class BackupService(Flushing, ReadBack, Release, Scrubbing, Service):
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
        self.scrub_rate, self.scrub_every = scrub_rate, scrub_every
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
        self._dir_dirty = False
        self._syncing = False   # a sync round is under way (``_syncer``)
        self.stopping = False
        self.counters = dict.fromkeys(
            ("replicate_rpcs", "replicate_entries", "chunks", "bytes_received", "duplicates",
             "bytes_flushed", "fsyncs", "errors", "write_errors", "reads", "bytes_read", "drops",
             "trims", "tiered_reads", "tiered_bytes", "claims", "releases", "scrubbed_bytes",
             "scrub_passes", "damage"), 0)
        self.metrics = None   # kera.metrics.backup, with --metrics-port
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
        async with open_pool(credentials=self.credentials) as pool, trio.open_nursery() as nursery:
            self.pool = pool
            self.port = await nursery.start(self.serve, host, port)
            self.addr = advertised(host, self.port, self.advertise)
            nursery.start_soon(self._flusher)
            if not self.always:
                nursery.start_soon(self._syncer)
            if self.scrub_rate:
                nursery.start_soon(self._scrubber)
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

    def holds(self) -> list[list]:
        return self.store.holds()

    # -- replicate -----------------------------------------------------------

    def rpc_replicate(self, meta: dict, payload):
        """New bytes of one vseg copy, or (with ``entries``) of every copy a broker has for
        this backup: [vlog, vseg, offset, close, length] each, over consecutive parts of the
        payload. Each entry is taken or refused by the store's rules on its own; a batch is
        answered at once, after one durability wait for all its entries, with each one's
        length or typed error. A malformed request is refused whole and stores nothing."""
        self.counters["replicate_rpcs"] += 1
        try:
            if self.stopping:
                raise BackupError("backup shutting down")
            batch = "entries" in meta
            epoch = meta.get("epoch") or 0
            if not batch and (meta.get("vlog") is None or meta.get("vseg") is None
                              or meta.get("offset") is None):
                raise InvalidArgument("replicate needs entries, or vlog, vseg and offset")
            entries = self._entries(meta, payload) if batch else [
                (vseg_key(meta), meta["offset"], meta.get("close") is True, _stable(payload), None)]
        except KeraError:
            self.counters["errors"] += 1
            raise
        self.counters["replicate_entries"] += len(entries)
        results: list = [0] * len(entries)   # each entry's length, or its error
        waits: list[tuple[int, Replica, int, bool]] = []   # entries answered once on disk
        new: list[Replica] = []                            # replicas whose files are to be made
        for i, (key, offset, close, data, scans) in enumerate(entries):
            try:
                d = self.store.replicate(key, epoch, offset, data, close, scans)
            except KeraError as e:
                self.counters["errors"] += 1
                results[i] = e
                continue
            if d.kind == EMPTY:
                continue
            if d.kind == DUPLICATE:
                self.counters["duplicates"] += 1
            else:
                self.counters["chunks"] += d.chunks
                self.counters["bytes_received"] += d.take
            if d.kind == NEW:
                d.replica.ready = trio.Event()
                new.append(d.replica)
            if self._acked(d.replica, d.length, close):
                results[i] = d.length
            else:
                waits.append((i, d.replica, d.length, close))
        if waits and not new and self.write_through and self._write_now():
            waits = self._settle(waits, results)
        if new or waits:
            return self._answer_later(batch, results, waits, new)
        return self._answer(batch, results)

    def _entries(self, meta: dict, payload) -> list[tuple]:
        """A batch's entries as (key, offset, close, bytes, their chunks if scanned): adding up
        to the payload, or an ``InvalidArgument`` (nothing stored)."""
        broker, entries = meta["broker"], meta["entries"]
        mv = _stable(payload)
        if mv.nbytes > MAX_REPLICATE_BYTES:
            raise LimitExceeded(f"replicate payload of {mv.nbytes} bytes exceeds "
                                f"{MAX_REPLICATE_BYTES}", limit="MAX_REPLICATE_PAYLOAD",
                                bound=MAX_REPLICATE_BYTES, size=mv.nbytes)
        starts, pos = [], 0
        for e in entries:
            starts.append(pos)
            pos += e[4]
        if pos != mv.nbytes:
            raise InvalidArgument(f"replicate entries add up to {pos} bytes, the payload has "
                                  f"{mv.nbytes}")
        sizes = [e[4] for e in entries]
        return [((broker, e[0], e[1]), e[2], e[3], mv[o:o + n], scan)
                for e, o, n, scan in zip(entries, starts, sizes, _scans(mv, starts, sizes),
                                         strict=True)]

    @staticmethod
    def _answer(batch: bool, results: list):
        if batch:
            return {"results": [r.to_wire() if isinstance(r, KeraError) else r for r in results]}
        if isinstance(results[0], KeraError):
            raise results[0]
        return {"length": results[0]}

    def _acked(self, rep: Replica, end: int, close: bool) -> bool:
        """Whether an entry may be answered: its replica's file exists and its bytes (and close)
        are where the --fsync mode wants them; a replica that failed raises why."""
        if not rep.ready.is_set():
            return False
        if rep.failed:
            raise BackupError(rep.failed)
        if self.always:
            if rep.synced >= end and (not close or rep.trailer_synced):
                return True
        elif self.write_through:
            if rep.flushed >= end and (not close or rep.trailer_written):
                return True
        else:
            return True
        if rep.dropped:
            raise BackupError(f"replica {rep.key} was dropped")
        if rep.error:
            raise BackupError(f"replica {rep.key}: {rep.error}")
        return False

    async def _answer_later(self, batch: bool, results: list, waits: list, new: list[Replica]):
        """Create the new replicas' files, then wait for the flusher until every waiting entry is
        on disk or failed: one round serves them all."""
        with trio.CancelScope(shield=True):  # a creation is finished even if the caller goes away
            for rep in new:
                await self._create_file(rep)
        while waits:
            for _, rep, _, _ in waits:
                if not rep.ready.is_set():
                    await rep.ready.wait()  # a file another replicate is creating
            if waits := self._settle(waits, results):
                done = self._round_done
                self._kick.set()
                await done.wait()
        return self._answer(batch, results)

    def _settle(self, waits: list, results: list) -> list:
        """Each waiting entry's result if it may be answered now (its length, or why not);
        returns those still waiting."""
        pending = []
        for w in waits:
            i, rep, end, close = w
            try:
                if self._acked(rep, end, close):
                    results[i] = end
                else:
                    pending.append(w)
            except BackupError as e:
                self.counters["errors"] += 1
                results[i] = e
        return pending

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

    # -- list ------------------------------------------------------------------

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

    # -- fencing and recovery ------------------------------------------------

    def apply_fences(self, fences) -> None:
        self.store.apply_fences(fences)

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
                "claimed_files": len(self.claims.owners), "door": self.door.describe()}


# -- command line ----------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kera backup", description="Run a kera backup service.")
    p.add_argument("--dir", required=True, help="data directory (segment files, backup.id)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                   help="address brokers and the coordinator reach this backup at (default: "
                        "--host and the port bound)")
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
    p.add_argument("--scrub-rate", type=int, default=DEFAULT_RATE, metavar="BYTES_PER_S",
                   help="read every chunk on disk back and verify it, at this rate (0: never)")
    p.add_argument("--scrub-every", type=float, default=DEFAULT_EVERY, metavar="SECONDS",
                   help="a scrubbing pass starts at most this often")
    p.add_argument("--log-level", default="INFO")
    metrics.add_arguments(p)
    secret_.add_arguments(p)
    tls_.add_arguments(p)
    door.add_arguments(p)
    return p


async def _main(args, cluster_secret: bytes, tls) -> bool:
    svc = BackupService(args.dir, fsync=args.fsync, flush_interval=args.flush_interval,
                        fsync_interval=args.fsync_interval, max_bytes=args.max_bytes,
                        max_memory=args.max_memory, coordinator=args.coordinator, node=args.node,
                        scrub_rate=args.scrub_rate, scrub_every=args.scrub_every,
                        cluster_secret=cluster_secret, auth=args.auth, door=Door(door.from_args(args)),
                        tls=tls, advertise=args.advertise)
    if args.metrics_port is not None:
        from ..metrics.backup import install
        install(svc)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as outer:
            if svc.metrics is not None:   # served until the backup has flushed and stopped
                await outer.start(svc.metrics.serve, args.metrics_host or args.host, args.metrics_port)
            async with trio.open_nursery() as nursery:
                await nursery.start(svc.run, args.host, args.port)
                print(f"backup {svc.id if svc.id is not None else '-'} listening on {svc.addr}", flush=True)
                async for sig in signals:
                    log.info("signal %d: flushing and exiting", sig)
                    svc.stop()
                    break
            outer.cancel_scope.cancel()
    return not svc.store.dirty


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    cluster_secret = secret_.from_args(ap, args)
    tls = tls_.from_args(ap, args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.makedirs(args.dir, exist_ok=True)
    return 0 if trio.run(_main, args, cluster_secret, tls) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
