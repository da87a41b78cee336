"""Deterministic simulation of the replication and recovery core (``python -m kera.sim``).

The real decision code runs unchanged (``kera.vlog``, ``kera.backup.store``, the broker's
``MemoryBudget`` and ``Rebuilder``, ``kera.recovery.plan`` and ``repoint_plan``); what is
simulated is everything they do not decide:

- ``world``: ``World``, one seeded run: the clock (an event heap), the network, the broker's
  replicators, its producers, its death and recovery, the invariants after every step.
- ``backups``: ``SimBackup`` and its ``SimReplica`` copies (chunk ids, not bytes).
- ``faults``: ``Faults``, pauses, crashes, full disks, bit flips, torn tails, lost disks.
- ``placement``: ``SimPlacement``, the broker's placement of chunks in streamlets, groups
  and segments, under its memory budget.
- ``rebuild``: ``SimRebuild``, the I/O of the broker's rebuilding of lost copies.
- ``repointing``: recovery's re-pointing over simulated backups, and what the new owners
  end with checked.
"""

from collections import Counter

from .world import Violation, World

__all__ = ["Violation", "World", "run_seeds"]

REPOINTED = ("adopted_segments", "adopted_closed", "adopted_chunks", "adopted_unacked", "skipped_vsegs",
             "index_refused", "evictions", "refused", "budget_closes", "adopted_beside", "rebuilt",
             "lost_for_good", "copies_dropped", "strays_found", "index_rows", "index_runs")


def run_seeds(seeds) -> dict:
    """Run every seed; the first violation is raised (its message replays the seed). Returns
    the totals: seeds, chunks, steps, what recovery re-pointed (``REPOINTED``) and how many
    seeds adopted a segment."""
    out = Counter()
    for seed in seeds:
        r = World(seed).run()
        out.update({k: r.get(k, 0) for k in ("chunks", "steps", *REPOINTED)})
        out["seeds"] += 1
        out["seeds_adopting"] += r.get("adopted_segments", 0) > 0
    return dict(out)
