"""Deterministic simulation of the replication and recovery core (``python -m kera.sim``)."""

from collections import Counter

from .world import Violation, World

__all__ = ["Violation", "World", "run_seeds"]

REPOINTED = ("adopted_segments", "adopted_closed", "adopted_chunks", "adopted_unacked", "skipped_vsegs",
             "index_refused", "evictions", "refused", "budget_closes", "adopted_beside", "rebuilt",
             "lost_for_good", "copies_dropped", "index_rows", "index_runs")


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
