"""``python -m kera.sim --seeds N [--start S]``: run seeded simulations, stop at the first failure.

``--seed S`` replays one seed and prints its event log on failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter

from . import REPOINTED
from .world import Violation, World


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kera.sim")
    ap.add_argument("--seeds", type=int, default=1000, help="how many seeds to run")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--seed", type=int, default=None, help="replay this one seed")
    args = ap.parse_args(argv)
    logging.getLogger("kera").setLevel(logging.ERROR)   # the broker code's warnings: simulated faults
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    t0 = time.perf_counter()
    n, sums = 0, Counter()
    for seed in seeds:
        try:
            r = World(seed).run()
        except Violation as e:
            print(f"FAILED {e}", file=sys.stderr)
            print(f"replay: python -m kera.sim --seed {seed}", file=sys.stderr)
            return 1
        n += 1
        sums.update({k: r.get(k, 0) for k in ("chunks", *REPOINTED)})
        sums["seeds_adopting"] += r.get("adopted_segments", 0) > 0
    dt = time.perf_counter() - t0
    print(f"{n} seeds clean, {sums['chunks']} chunks, {dt:.1f} s, {n / dt:.0f} seeds/s")
    print(f"re-pointed: {sums['seeds_adopting']} seeds adopted {sums['adopted_segments']} segments "
          f"({sums['adopted_closed']} closed by their close chunk, {sums['adopted_chunks']} chunks, "
          f"{sums['adopted_unacked']} not acknowledged yet; {sums['adopted_beside']} groups adopted beside the "
          f"replay), {sums['skipped_vsegs']} vsegs not replayed, planned from {sums['index_runs']} runs "
          f"of chunks ({sums['index_rows']} chunks' rows, the same plan), "
          f"{sums['index_refused']} copies refused by index; {sums['evictions']} segments evicted, "
          f"{sums['refused']} chunks refused (budget), {sums['budget_closes']} idle vlogs' open vsegs "
          f"closed for it; {sums['lost_for_good']} backups lost for good one after the other, "
          f"{sums['rebuilt']} copies of frozen vsegs made again, {sums['copies_dropped']} dropped as "
          f"short after a restart, {sums['strays_found']} whole copies the vlog had given up on "
          f"taken as sources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
