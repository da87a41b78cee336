"""Deterministic simulation of the replication and recovery core (``python -m kera.sim``)."""

from .world import Violation, World

__all__ = ["Violation", "World", "run_seeds"]


def run_seeds(seeds) -> dict:
    """Run every seed; the first violation is raised (its message replays the seed)."""
    chunks = steps = 0
    n = 0
    for seed in seeds:
        r = World(seed).run()
        chunks += r["chunks"]
        steps += r["steps"]
        n += 1
    return {"seeds": n, "chunks": chunks, "steps": steps}
