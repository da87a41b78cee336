"""Which backups get a virtual segment's copies.

Copies of one virtual segment live in distinct backup processes: first on
distinct nodes other than the broker's own, then on any other node's backup,
and only then on the broker's own node (a one-node cluster still gets a disk
copy, which survives a process kill). Least loaded first, ties broken by a
seeded random draw so that the choice replays exactly in the simulator.
"""

from __future__ import annotations

import random
from collections.abc import Container, Iterable


class BackupSet:
    """The live backups as this broker last heard of them, and the copies it gave each."""

    def __init__(self, own_node: str, rng: random.Random | None = None):
        self.own_node = own_node
        self.rng = rng or random.Random()
        self.live: dict[int, str] = {}    # backup id -> node
        self.epochs: dict[int, int] = {}  # backup id -> its incarnation
        self.load: dict[int, int] = {}    # copies given to each backup, ever
        self.version = 0                  # bumped on every membership change

    def set_live(self, live: dict[int, tuple[str, int]]) -> list[int]:
        """New membership, backup id -> (node, incarnation); returns the backups gone or restarted."""
        changed = [b for b in self.live if b not in live or live[b][1] != self.epochs[b]]
        nodes = {b: node for b, (node, _) in live.items()}
        epochs = {b: epoch for b, (_, epoch) in live.items()}
        if nodes != self.live or epochs != self.epochs:
            self.live, self.epochs = nodes, epochs
            self.version += 1
        return changed

    def incarnation(self, backup: int) -> int:
        return self.epochs.get(backup, -1)

    def alive(self, backup: int) -> bool:
        return backup in self.live

    def choose(self, holding: Iterable[int], avoid: Container[int], k: int) -> list[int]:
        """Up to ``k`` more backups for a virtual segment whose copies are on ``holding``."""
        holding = set(holding)
        used = {self.live[b] for b in holding if b in self.live}
        cands = [b for b in sorted(self.live) if b not in holding and b not in avoid]
        self.rng.shuffle(cands)
        cands.sort(key=lambda b: self.load.get(b, 0))
        out: list[int] = []
        tiers = (lambda b: self.live[b] != self.own_node and self.live[b] not in used,
                 lambda b: self.live[b] != self.own_node,
                 lambda b: True)
        for ok in tiers:
            for b in cands:
                if len(out) == k:
                    break
                if b not in out and ok(b):
                    used.add(self.live[b])
                    out.append(b)
                    self.load[b] = self.load.get(b, 0) + 1
        return out
