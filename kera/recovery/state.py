"""One recovery's state and progress: what ``kera status`` and the metrics show of it.

Every state a recovery goes through is here (``State``), and every figure it keeps:
the manager (``kera.recovery.manager``) moves a ``Recovery`` from one state to the next,
the re-pointing (``kera.recovery.repoint``) adds its counts and timings to it.
"""

from __future__ import annotations

import enum
import time
from contextlib import contextmanager


class State(enum.StrEnum):
    PLANNING = "planning"     # fencing, new owners assigned recovering, the backups listed
    REPLAYING = "replaying"   # re-pointing, replaying, then the hand-over
    DONE = "done"             # handed over (data lost, if any, in ``lost`` and ``unproven``)
    FAILED = "failed"         # abandoned: planned again from the start after a delay
    WAITING = "waiting"       # too many backups that may hold its copies are down: not begun


ACTIVE = (State.PLANNING, State.REPLAYING, State.WAITING)   # not ended

# a recovery's phases, in order, each timed (wall and this process's CPU): fencing the dead
# incarnation, assigning its streamlets recovering, listing the backups' holdings, planning the
# replay, indexing the settled vsegs, planning the re-pointing, adopting (the new owners build
# the segments), replaying the rest (the adoptions settle meanwhile: durable, claimed), handing
# over (assigned serving, metadata committed)
PHASES = ("fence", "assign", "list", "plan", "index", "repoint", "adopt", "replay", "handover")


class Recovery:
    """One attempt at recovering incarnation (``broker``, ``epoch``): its state, what it did and
    what it lost, timed per phase, as ``kera status`` shows it."""

    def __init__(self, broker: int, epoch: int, streamlets: list):
        self.broker = broker
        self.epoch = epoch
        self.streamlets = streamlets        # [(stream name, index)]
        self.started = time.time()
        self.finished: float | None = None
        self.served: float | None = None    # the new owners serve (the hand-over committed)
        self.state = State.PLANNING
        self.vlogs = 0
        self.sources: set[int] = set()      # backups replaying
        self.chunks = 0
        self.bytes = 0
        self.total = 0                      # bytes of the vsegs to replay (longest copies)
        self.error = ""
        self.steps = 0                      # replay steps (one copy, from one offset)
        self.corrupt_steps = 0              # steps that stopped on a corrupt chunk
        self.failed_steps = 0               # steps whose backup failed
        self.lost: list[dict] = []          # ranges no copy could deliver (vlog, vseg, offset, end)
        self.adopted_segments = 0           # re-pointed at the backups' copies, not replayed
        self.adopted_bytes = 0
        self.wall = dict.fromkeys(PHASES, 0.0)   # seconds per phase
        self.cpu = dict.fromkeys(PHASES, 0.0)    # the coordinator's CPU seconds per phase
        self.settle_seconds = 0.0           # the longest settle of a new owner (beside the replay)
        self.deferred: dict = {}            # groups adopted after the hand-over (kera.recovery.adoption)
        self.index_rows = 0                 # rows the re-pointing planned from (a row per run of chunks)
        self.index_chunks = 0               # ... the chunks they stand for
        self.reindexed_vsegs = 0            # vsegs asked again for their chunks' own rows
        # backups that may hold copies, down when the grace ran out: gone on without proof
        self.unproven: list[int] = []

    @contextmanager
    def phase(self, name: str):
        """Time a phase of this recovery (see ``PHASES``)."""
        t, c = time.monotonic(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] += time.monotonic() - t
            self.cpu[name] += time.process_time() - c

    def describe(self) -> dict:
        end = self.finished or time.time()
        return {"broker": self.broker, "epoch": self.epoch, "state": self.state.value,
                "streamlets": len(self.streamlets), "vlogs": self.vlogs,
                "backups": len(self.sources), "chunks": self.chunks, "bytes": self.bytes,
                "total_bytes": self.total,
                "seconds": round(end - self.started, 3),
                "serve_seconds": round((self.served or end) - self.started, 3),
                "rate_mb_s": round(self.bytes / max(end - self.started, 1e-6) / 1e6, 2),
                "steps": self.steps, "corrupt_steps": self.corrupt_steps,
                "failed_steps": self.failed_steps, "lost": list(self.lost), "error": self.error,
                "adopted_segments": self.adopted_segments, "adopted_bytes": self.adopted_bytes,
                **{f"{p}_seconds": round(t, 4) for p, t in self.wall.items()},
                "settle_seconds": round(self.settle_seconds, 4),
                "deferred_groups": sum(len(gs) for gs, *_ in self.deferred.values()),
                "index_rows": self.index_rows, "index_chunks": self.index_chunks,
                "reindexed_vsegs": self.reindexed_vsegs, "unproven": self.unproven,
                "cpu_ms": {p: round(t * 1e3, 1) for p, t in self.cpu.items()}}
