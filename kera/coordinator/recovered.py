"""Recovered incarnations: the dead ones whose files every backup lets go (coordinator side).

Once the recovery of an incarnation (broker, epoch) has handed its
streamlets over with nothing lost, nothing on the backups is needed of it
but the files new owners claimed (``kera.backup.claims``): each backup drops
its files of that incarnation (a claimed one is only marked dropped) and
releases the claims the incarnation made itself. A backup that is down,
partitioned, or fails a request when the recovery ends must do it when it is
back, so the list is metadata (``recovered``: [[broker, epoch, version],
...], ``recovered_version``: the newest entry's) and reaches every backup
through membership: a backup says in its registration and heartbeats which
version it applied, and the answer carries the list only when that is not
the current one (one integer compared per heartbeat otherwise). Applying it
is idempotent.

An entry is recorded with the hand-over's owners and told only once a
commit made both durable (``durable``), so a coordinator that stops between
them forgets neither alone. A new term tells what it loaded, less any entry
whose incarnation still owns streamlets (etcd may have stored the entry
without all of the owners): that one is recovered again, and added again.

Bound: the entries every backup ever registered has reported applied are
removed, so the list only grows while a known backup stays away, by one
entry (about 10 bytes) per clean recovery.
"""

from __future__ import annotations

import logging

from .membership import Roster
from .metadata import Metadata

log = logging.getLogger("kera.coordinator")


class Recovered:
    """The recovered list of the term's ``metadata``, told to the ``roster``'s backups."""

    def __init__(self, metadata: Metadata, roster: Roster):
        self.metadata, self.roster = metadata, roster
        meta = metadata.state
        held = [r for r in meta["recovered"] if metadata.holdings.count((r[0], r[1]))]
        if held:
            log.warning("incarnations %s still own streamlets: recovered again before their files go",
                        [r[:2] for r in held])
            metadata.set(("recovered",), [r for r in meta["recovered"] if r not in held])
        self.shown = meta["recovered_version"]   # the newest version backups are told

    def add(self, broker: int, epoch: int, covered: list) -> None:
        """``(broker, epoch)`` was recovered with nothing lost, its replay going through
        ``covered`` ([[vlog, last vseg], ...]: only files within it go): recorded now, told to
        the backups once the next commit returns."""
        md = self.metadata
        version = md.state["recovered_version"] + 1
        md.set(("recovered",), [*md.state["recovered"], [broker, epoch, version, covered]])
        md.set(("recovered_version",), version)

    def durable(self, version: int) -> None:
        """A commit made every entry up to ``version`` durable: they may be told."""
        self.shown = max(self.shown, version)

    def answer(self, m, applied) -> dict:
        """What backup ``m``'s registration or heartbeat answer carries, given the version it
        says it ``applied``: the list if that is not the current one."""
        version = self.shown
        if type(applied) is not int:
            applied = None
        caught_up = applied == version and m.recovered != version
        m.recovered = applied
        if applied != version:
            return {"recovered": {"version": version, "incarnations": [
                [r[0], r[1], r[3] if len(r) > 3 else []] for r in self.metadata.state["recovered"]
                if r[2] <= version]}}
        if caught_up and self.metadata.state["recovered"]:
            self._prune(version)
        return {}

    def _prune(self, version: int) -> None:
        """Remove the entries every backup ever registered has applied."""
        members, state = self.roster.members["backup"], self.metadata.state
        if all((m := members.get(b)) is not None and m.recovered == version
               for b in state["backups"]):
            entries = state["recovered"]
            left = [r for r in entries if r[2] > version]
            log.info("every backup let go of %d recovered incarnations", len(entries) - len(left))
            self.metadata.set(("recovered",), left)

    def describe(self) -> dict:
        return {"version": self.shown, "pending": len(self.metadata.state["recovered"])}
