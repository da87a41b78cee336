"""Releasing replicas: files deleted once nothing needs them, kept while claimed.

A broker trims the vsegs below a vlog's floor (nothing live in them); the coordinator
lets go of dead incarnations it recovered with nothing lost. Either way a file an owner
claims (an adopted segment reads it) is only marked dropped, and deleted with its last
claim. Floors and claims are persisted before the answer, so a restart keeps them.
"""

from __future__ import annotations

import logging
import os

import trio

from .. import metafile
from ..errors import Fenced, InvalidArgument
from ..vlog import vlog_epoch
from ..wire.fields import U63
from .claims import FileClaims
from .flushing import Flusher
from .replica import Replica
from .store import BackupStore

log = logging.getLogger("kera.backup")

FLOORS_FILE = "floors.meta"    # (broker, vlog) -> vsegs below were released by their broker
CLAIMS_FILE = "claims.meta"    # dead incarnations' vseg files that live owners read (claims)


class Release:
    """The backup's trims, claims and let-go: it owns the claims and the floors' and claims'
    files in the data ``directory``; handed the ``store`` (which replicas, their floors), the
    service's ``counters`` and the ``flusher`` (files deleted under its I/O lock)."""

    def __init__(self, store: BackupStore, counters: dict, directory: str, flusher: Flusher):
        self.store, self.counters, self.dir, self.flusher = store, counters, directory, flusher
        self.claims = FileClaims()
        self._claims_changed = self._claims_saved = 0   # changes made, changes on disk
        self._files = trio.Lock()   # one write of the floors' or the claims' file at a time

    async def load(self) -> None:
        """The floors and claims a restart finds, and what was due to go before it stopped:
        the vsegs below a floor, the dropped files whose last claim was released."""
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
        async with self._files:
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
        await self.flusher.unlink([rep])
        self.store.reclaimed += size
        return size

    async def trim(self, meta: dict) -> dict:
        """The broker released the vsegs of a vlog below ``floor`` (nothing live in them):
        the floor is recorded first (a recovery then knows they are not lost), then their
        files are deleted."""
        b, v, floor = meta["broker"], meta["vlog"], meta["floor"]
        self.counters["trims"] += 1
        if self.store.raise_floor(b, v, floor):
            body = self.store.floor_list()
            async with self._files:
                await trio.to_thread.run_sync(metafile.save, os.path.join(self.dir, FLOORS_FILE), body)
        return {"bytes": await self._release_below_floor(self.store.below_floor(b, v))}

    async def claim(self, meta: dict) -> dict:
        """``owner`` (broker, ``epoch``) reads the listed vseg files of dead incarnations
        (``claims``: [[broker, vlog, vseg], ...]): they outlive their recovery's drop until
        released. Recorded before the answer; ``held``: per file, whether it is here."""
        owner = (meta["owner"], meta["epoch"])
        keys = [tuple(k) for k in meta["claims"]]
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

    async def release(self, meta: dict) -> dict:
        """``owner`` no longer reads ``claims`` (all its claims if absent): a dropped file no
        claim holds any more is deleted."""
        owner = (meta["owner"], meta["epoch"])
        keys = [tuple(k) for k in meta["claims"]] if meta.get("claims") is not None else None
        _, changed = self.claims.release(owner, keys)
        self.counters["releases"] += 1
        if changed:
            await self._save_claims()
        return {"bytes": await self._delete_unclaimed()}

    async def let_go(self, incarnations) -> dict:
        """The coordinator recovered these dead incarnations ([[broker, epoch, [[vlog, last
        vseg], ...]], ...]) with nothing lost (``kera.coordinator.recovered``): every file of theirs here
        within what the recovery went through is deleted, or only marked dropped while an owner
        claims it, and every claim they made is released. A file outside it (a vlog or vseg
        whose copies were all down then) may hold all there is of it: it is kept, and so are
        that incarnation's claims. Idempotent."""
        if not isinstance(incarnations, list) or not all(
                isinstance(i, list) and len(i) == 3 and all(type(x) is int and 0 <= x < U63 for x in i[:2])
                and isinstance(i[2], list) and all(
                    isinstance(c, list) and len(c) == 2 and all(type(x) is int and 0 <= x < U63 for x in c)
                    for c in i[2])
                for i in incarnations):
            raise InvalidArgument("recovered incarnations must be [[broker, epoch, [[vlog, vseg], ...]], ...]")
        covered = {(b, e): dict(map(tuple, c)) for b, e, c in incarnations}
        if not covered:
            return {"dropped": 0, "claimed": 0, "bytes": 0}
        mine = [k for k in self.store.replicas if (k[0], vlog_epoch(k[1])) in covered]
        keys = [k for k in mine if k[2] <= covered[(k[0], vlog_epoch(k[1]))].get(k[1], -1)]
        outside = {(k[0], vlog_epoch(k[1])) for k in set(mine) - set(keys)}
        if outside:
            log.warning("files of recovered incarnations %s lie past what their recovery replayed: "
                        "kept, with their claims", sorted(outside))
        dead = set(covered) - outside
        claimed = {k for k in keys if self.claims.drop(k)}
        reps = [self.store.drop(k) for k in keys if k not in claimed]
        released = self.claims.release_owners(dead)
        if claimed or released:
            await self._save_claims()
        if reps:
            self.flusher.kick()  # wake durability waiters so they see it
            self.counters["drops"] += len(reps)
            await self.flusher.unlink(reps)
        freed = await self._delete_unclaimed()
        if reps or freed:
            log.info("let go of recovered incarnations %s: %d files deleted, %d kept for their claims, "
                     "%d bytes of files they claimed freed", sorted(dead), len(reps), len(claimed), freed)
        return {"dropped": len(reps), "claimed": len(claimed), "bytes": freed}
