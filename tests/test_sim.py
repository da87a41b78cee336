"""The deterministic simulation of the replication and recovery core.

A fixed set of seeds runs here; ``python -m kera.sim --seeds N`` runs more.
Bugs the simulator must catch are re-introduced on purpose and found.
"""

from __future__ import annotations

import math

import pytest

from kera.sim import Violation, World, run_seeds
from kera.vlog import VirtualLog

CI_SEEDS = range(300)


def test_fixed_seeds_run_clean():
    r = run_seeds(CI_SEEDS)
    assert r["seeds"] == len(CI_SEEDS) and r["chunks"] > 0


def test_a_seed_replays_exactly():
    a, b = World(41).run(), World(41).run()
    assert a == b


def first_failing(seeds) -> tuple[int, str]:
    for seed in seeds:
        try:
            World(seed).run()
        except Violation as e:
            return seed, str(e)
    pytest.fail("no seed caught the re-introduced bug")


def test_catches_a_backup_given_up_on_forever(monkeypatch):
    """The wedge of old: a vseg's failed backups were never usable again."""
    drop = VirtualLog._drop_copy

    def never_again(self, vs, backup, now, avoid):
        drop(self, vs, backup, now, avoid)
        if avoid:
            vs.avoid[backup] = math.inf

    monkeypatch.setattr(VirtualLog, "_drop_copy", never_again)
    seed, why = first_failing(range(300))
    assert "no progress" in why, why


def test_catches_r1_without_a_disk_copy(monkeypatch):
    """The single-node loss of old: R=1 kept no backup copy."""
    init = VirtualLog.__init__

    def no_copy_for_r1(self, *a, **kw):
        init(self, *a, **kw)
        self.need = self.replication - 1

    monkeypatch.setattr(VirtualLog, "__init__", no_copy_for_r1)
    seed, why = first_failing(range(300))
    assert "no progress" in why or "lost" in why, why
