"""Recovered incarnations: the dead ones whose files every backup lets go (coordinator side).

Once the recovery of an incarnation (broker, epoch) has handed its
streamlets over with nothing lost, nothing on the backups is needed of it
but the files new owners claimed (``kera.backup.claims``): each backup drops
its files of that incarnation (a claimed one is only marked dropped) and
releases the claims the incarnation made itself. A backup that is down,
partitioned, or fails the request when the recovery ends must do it when it
is back, so the list is metadata (``recovered``: [[broker, epoch], ...],
``recovered_version``: bumped on each addition; recorded only once the
hand-over is durable, so a restarted coordinator never recovers again what a
backup let go of) and reaches every backup through membership: a backup says
in its registration and heartbeats which version it applied, and the answer
carries the list only when that is not the current one (one integer compared
per heartbeat otherwise). Applying it is idempotent.

Bound: the list is emptied once every backup ever registered has reported
the current version, so it only grows while a known backup stays away, by
one pair (about 10 bytes) per clean recovery.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kera.coordinator")


class Recovered:
    def __init__(self, coord):
        self.coord = coord

    async def add(self, broker: int, epoch: int) -> None:
        """``(broker, epoch)`` was recovered with nothing lost: durable when this returns."""
        meta, store = self.coord.meta, self.coord.log
        store.set(("recovered",), [*meta["recovered"], [broker, epoch]])
        store.set(("recovered_version",), meta["recovered_version"] + 1)
        await self.coord.commit()

    def answer(self, m, applied) -> dict:
        """What backup ``m``'s registration or heartbeat answer carries, given the version it
        says it ``applied``: the list if that is not the current one."""
        meta = self.coord.meta
        version = meta["recovered_version"]
        caught_up = applied == version and m.recovered != version
        m.recovered = applied
        if applied != version:
            return {"recovered": {"version": version, "incarnations": meta["recovered"]}}
        if caught_up and meta["recovered"]:
            self._prune(version)
        return {}

    def _prune(self, version: int) -> None:
        """Empty the list once every backup ever registered applied it."""
        members = self.coord.members["backup"]
        if all((m := members.get(b)) is not None and m.recovered == version
               for b in self.coord.meta["backups"]):
            log.info("every backup let go of %d recovered incarnations", len(self.coord.meta["recovered"]))
            self.coord.log.set(("recovered",), [])

    def describe(self) -> dict:
        return {"version": self.coord.meta["recovered_version"],
                "pending": len(self.coord.meta["recovered"])}
