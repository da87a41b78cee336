"""Claims: which live owners still read a dead incarnation's vseg files (sans-IO).

A recovery may hand a dead broker's settled segments to new owners as
evicted segments that read their chunks from the dead incarnation's vseg
files (``kera.broker.adopted``). Those files must outlive the backups'
letting go of the dead incarnation (``kera.coordinator.recovered``) and must go once
nobody reads them:

- an owner *claims* (broker, vlog, vseg) here before its adoption is
  answered (only a file this backup holds can be claimed);
- letting go of a claimed file only marks it *dropped*;
- an owner *releases* its claim once no index chunk of its own naming the
  vseg can be replayed; the end of a recovery releases every claim of the
  dead incarnation (its successors claimed what they adopted again first),
  on every backup, also one that was down then (``kera.coordinator.recovered``);
- a dropped file with no claim left is deleted.

The state is small (one entry per claimed vseg) and persisted in one
checksummed file beside the floors, rewritten on every change, so a restart
keeps the claims and deletes what was due.
"""

from __future__ import annotations

Key = tuple[int, int, int]
Owner = tuple[int, int]   # (broker id, epoch)


class FileClaims:
    """Per vseg file, the owners that claim it, and the files dropped but kept for them."""

    def __init__(self):
        self.owners: dict[Key, set[Owner]] = {}
        self.dropped: set[Key] = set()   # let go by their recovery, kept for their claims

    def load(self, entries) -> None:
        """From ``dump()``: [[broker, vlog, vseg, dropped, [[owner, epoch], ...]], ...]."""
        for b, v, s, dropped, owners in entries or []:
            key = (int(b), int(v), int(s))
            if owners:
                self.owners[key] = {(int(o), int(e)) for o, e in owners}
            if dropped:
                self.dropped.add(key)

    def dump(self) -> list:
        keys = sorted(self.owners.keys() | self.dropped)
        return [[*k, k in self.dropped, sorted(map(list, self.owners.get(k, ())))] for k in keys]

    def claim(self, owner: Owner, keys, held) -> tuple[list[bool], bool]:
        """``owner`` claims ``keys``; ``held(key)``: the file is here. Returns per key whether it
        was claimed, and whether anything changed."""
        out, changed = [], False
        for key in keys:
            ok = held(key)
            out.append(ok)
            if ok:
                owners = self.owners.setdefault(key, set())
                if owner not in owners:
                    owners.add(owner)
                    changed = True
        return out, changed

    def release(self, owner: Owner, keys=None) -> tuple[list[Key], bool]:
        """``owner`` lets go of ``keys`` (all its claims if None). Returns the dropped files no
        claim holds any more (to delete), and whether anything changed."""
        if keys is None:
            changed = self.release_owners({owner})
            return self.due(), changed
        changed = False
        for key in keys:
            owners = self.owners.get(key)
            if owners is not None and owner in owners:
                owners.discard(owner)
                changed = True
                if not owners:
                    del self.owners[key]
        return self.due(), changed

    def release_owners(self, owners: set[Owner]) -> bool:
        """Every claim of ``owners`` goes (one pass, however many): whether any did."""
        changed = False
        for key in [k for k, os in self.owners.items() if not os.isdisjoint(owners)]:
            left = self.owners[key] - owners
            changed = True
            if left:
                self.owners[key] = left
            else:
                del self.owners[key]
        return changed

    def drop(self, key: Key) -> bool:
        """The recovery lets ``key`` go: True if claims keep its file (it is marked dropped)."""
        if key not in self.owners:
            return False
        self.dropped.add(key)
        return True

    def due(self) -> list[Key]:
        """Dropped files no claim holds: to delete."""
        return sorted(k for k in self.dropped if k not in self.owners)

    def deleted(self, key: Key) -> None:
        self.dropped.discard(key)
        self.owners.pop(key, None)

    def claimed(self, key: Key) -> bool:
        return key in self.owners
