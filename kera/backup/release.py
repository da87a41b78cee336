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
from ..errors import BackupError, Fenced, InvalidArgument
from ..vlog import vlog_epoch
from ..wire import U63
from . import disk
from .replica import Replica

log = logging.getLogger("kera.backup")

FLOORS_FILE = "floors.meta"    # (broker, vlog) -> vsegs below were released by their broker
CLAIMS_FILE = "claims.meta"    # dead incarnations' vseg files that live owners read (claims)


class Release:
    """``BackupService``'s trims, claims and let-go (its state: store, claims, counters)."""

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

    async def rpc_trim(self, meta: dict, payload):
        """The broker released the vsegs of a vlog below ``floor`` (nothing live in them):
        the floor is recorded first (a recovery then knows they are not lost), then their
        files are deleted."""
        b, v, floor = meta["broker"], meta["vlog"], meta["floor"]
        self.counters["trims"] += 1
        if self.store.raise_floor(b, v, floor):
            body = self.store.floor_list()
            async with self._floors_lock:
                await trio.to_thread.run_sync(metafile.save, os.path.join(self.dir, FLOORS_FILE), body)
        return {"bytes": await self._release_below_floor(self.store.below_floor(b, v))}

    async def rpc_claim(self, meta: dict, payload):
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

    async def rpc_release(self, meta: dict, payload):
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
