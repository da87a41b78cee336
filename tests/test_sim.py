"""The deterministic simulation of the replication and recovery core.

A fixed set of seeds runs here, and a window of seeds that moves with every commit, so that
each one explores seeds nobody ran; ``python -m kera.sim --seeds N`` runs more. Bugs the
simulator must catch are re-introduced on purpose and found.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kera import chunk
from kera.broker import memory
from kera.broker.rebuild import Rebuilder
from kera.recovery import repoint_plan as cols
from kera.sim import Violation, World, placement, repointing, run_seeds
from kera.vlog import VirtualLog

CI_SEEDS = range(300)
WINDOW = 250                     # seeds each commit explores besides the fixed ones (~10 s)
WINDOW_STARTS = (10**7, 10**9)   # where windows start: clear of the seeds swept by hand


def test_fixed_seeds_run_clean():
    r = run_seeds(CI_SEEDS)
    assert r["seeds"] == len(CI_SEEDS) and r["chunks"] > 0
    # recovery re-pointed settled history in most runs, groups' last segments by their close
    # chunks included, and left whole vsegs unread; the budget evicted segments, closing idle
    # vlogs' open vsegs for it
    assert r["seeds_adopting"] > len(CI_SEEDS) // 2, r
    assert min(r["adopted_closed"], r["skipped_vsegs"], r["evictions"], r["budget_closes"],
               r["adopted_beside"]) > 0, r
    # backups lost for good one after the other, frozen vsegs' copies made again each time
    assert min(r["lost_for_good"], r["rebuilt"]) > 0, r


@pytest.mark.parametrize("seed, what", [
    (13, "adopted_closed"),   # closed groups' last segments adopted, many vsegs skipped, evictions
    (617, "index_refused"),   # a copy whose rotten header its index found on reload, refused
    (506, "chunks"),          # one copy whole, one short: replayed, not adopted (was a loss)
    (980, "copies_dropped"),  # a restarted backup's torn frozen copy dropped, made again
])
def test_repointing_seeds_run_clean(seed, what):
    assert World(seed, window=1).run().get(what, 0) > 0


@pytest.mark.parametrize("seed", [
    70250,  # schedule: backup 5 lost for good 1.9 s after backup 2's disk, 2 not yet declared dead
    70531,  # schedule: the same, backup 3 lost for good 1.9 s after backup 2's disk
    71715,  # schedule: the same, backup 4 lost for good 1.7 s after backup 1's disk
    72544,  # kera: a segment refused for good below the low-water mark, its room held by one idle vseg
    1002713,  # kera: an answer from a torn backup's process before its restart counted its copy whole
    1008298,  # kera: the same, the copy counted 3,893 bytes long with 5 chunks torn off
    1011799,  # simulator: a paused backup declared dead, restarted by a torn tail, never re-admitted
    12172,  # kera: a frozen vseg's known copies lost, a whole one the vlog gave up on never looked for
    55786,  # kera: a stale length answer after the close left a copy closed but short, never asked again
    58572,  # kera: a copy made again on a backup that restarted with a torn tail meanwhile, counted whole
])
def test_seeds_found_failing_run_clean(seed):
    World(seed, window=1).run()


@pytest.mark.parametrize("seed", [
    125905,  # kera: a vseg whole on one copy only, a bit of a body flipped there unseen, adopted naming it
])
def test_seeds_found_failing_with_the_window_they_draw_run_clean(seed):
    """Seeds found failing with the window of in-flight messages they draw (``World``'s
    default), which they need to fail."""
    World(seed).run()


def window_start() -> int:
    """Where this tree's window of seeds starts: HEAD's commit hash taken into ``WINDOW_STARTS``,
    so every commit explores seeds nobody ran; without git (a tarball), kera's sources' hash."""
    root = Path(__file__).resolve().parent.parent
    try:
        key = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        key = ""
    if not key:
        h = hashlib.sha256()
        for path in sorted((root / "kera").rglob("*.py")):
            h.update(path.read_bytes())
        key = h.hexdigest()
    lo, hi = WINDOW_STARTS
    return lo + int(hashlib.sha256(key.encode()).hexdigest(), 16) % (hi - lo)


def test_a_window_of_new_seeds_runs_clean():
    """``WINDOW`` seeds from ``window_start()``: a failure prints the command that replays it
    (root-cause it, fix it, and add the seed to the fixed ones)."""
    start = window_start()
    print(f"seeds {start}..{start + WINDOW - 1}")
    for seed in range(start, start + WINDOW):
        try:
            World(seed).run()
        except Violation as e:
            why = str(e)
        else:
            continue
        pytest.fail(f"{why}\nreplay: python -m kera.sim --seed {seed}   (this commit's window: "
                    f"python -m kera.sim --start {start} --seeds {WINDOW})", pytrace=False)


def test_a_seed_replays_exactly():
    a, b = World(41).run(), World(41).run()
    assert a == b


def first_failing(seeds) -> tuple[int, str]:
    for seed in seeds:
        try:
            World(seed, window=1).run()
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


def test_catches_a_last_segment_adopted_without_its_close_chunk(monkeypatch):
    """A group's last listed segment taken as complete without its close chunk: the broker
    went on appending to it (or to the group) in vsegs past the settled prefix."""
    plan = repointing.plan_repoint

    def forged_closes(rows, settled, replayed=frozenset()):
        # every group's last segment in the rows gets a close chunk at its head
        last = {}
        for r in rows[rows[:, cols.FLAGS] & chunk.CLOSE == 0].tolist():
            key = (r[cols.STREAM], r[cols.STREAMLET], r[cols.GROUP])
            if key not in last or (r[cols.SEGMENT], r[cols.OFFSET]) > (last[key][cols.SEGMENT], last[key][cols.OFFSET]):
                last[key] = r
        forged = [[*r[:cols.OFFSET], r[cols.OFFSET] + r[cols.SIZE], *r[cols.OFFSET + 1:cols.FLAGS],
                   chunk.CLOSE, 0, 0, *r[cols.LAST:]] for r in last.values()]
        return plan(np.concatenate([rows, np.array(forged, np.uint64).reshape(-1, cols.COLUMNS)]),
                    settled, replayed)

    monkeypatch.setattr(repointing, "plan_repoint", forged_closes)
    seed, why = first_failing(range(300))
    assert "adopted as closed" in why or "lost" in why or "not its chunks" in why, why


def test_catches_a_filled_segment_taking_another_chunk(monkeypatch):
    """The broker's ``Group.append`` before its fix: a segment noted filled, the next one
    refused by the budget, took a smaller chunk, into its dropped buffer once evicted."""
    monkeypatch.setattr(placement.SimSegment, "filled_at", property(lambda seg: 0.0, lambda seg, v: None))
    seed, why = first_failing(range(2085, 2095))
    assert seed == 2090 and "evicted segment" in why, why


def test_catches_a_budget_spent_on_segments_waiting_in_idle_vlogs(monkeypatch):
    """The broker's ``MemoryBudget.relieve`` before its fix: it never closed the open vsegs
    that filled segments waited in, so a small budget spent on them refused every new
    segment for good, with every chunk durable."""
    monkeypatch.setattr(memory, "close_waiting", lambda seg: False)
    seed, why = first_failing(range(55, 65))
    assert seed == 59 and "refuses a new segment" in why, why


def test_catches_an_answer_from_before_a_backups_restart_taken(monkeypatch):
    """``VirtualLog`` before its fix: a replicate answered by a backup's process before a
    restart, the answer arriving once the restart was known, counted the restarted one's copy
    (torn shorter on its disk) whole: one copy fewer than acknowledged, for good."""
    restarted = VirtualLog._restarted

    def keeps_the_answer(self, vs, c):
        kept = [self.sent[t] for t in c.inflight if t in self.sent]
        restarted(self, vs, c)
        for s in kept:
            c.inflight.append(s.token)
            self.sent[s.token] = s

    monkeypatch.setattr(VirtualLog, "_restarted", keeps_the_answer)
    seed, why = first_failing(range(1002710, 1002720))
    assert seed == 1002713 and "copies not made again" in why, why


def test_catches_a_group_adopted_beside_the_replay_that_the_replay_continues(monkeypatch):
    """Every adopted group taken as ended (``Repoint.ended``), so adopted beside the replay:
    the replay sends chunks of groups whose adoption does not reach their end."""
    from kera.recovery.repoint_plan import Repoint
    monkeypatch.setattr(Repoint, "ended", lambda rp: {(a.stream, a.streamlet, a.group) for a in rp.adopted})
    seed, why = first_failing(range(100))
    assert "adopted beside the replay" in why, why


def test_catches_a_departed_backups_copy_taken_as_a_source(monkeypatch):
    """A frozen vseg keeps the copy of a backup that left (it may come back): a rebuilder
    counting it as whole would never make the copies a loss took."""
    monkeypatch.setattr(Rebuilder, "whole", lambda self, vs: [
        b for b, c in vs.copies.items() if c.closed and c.acked == vs.size])
    seed, why = first_failing(range(300))
    assert "copies not made again" in why, why


def test_catches_a_restarted_backups_short_copy_kept(monkeypatch):
    """A backup restarts with a frozen copy cut short (a torn tail): a rebuilder that did not
    ask what it reloaded would count that copy whole for good."""
    monkeypatch.setattr(Rebuilder, "verify", lambda self, backup, segments: 0)
    seed, why = first_failing([980, 2464])   # such a restart, then backups lost for good
    assert "copies not made again" in why, why
