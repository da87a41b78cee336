"""The coordinator's metrics: members, streams, recoveries and metadata commits, from its
state when scraped; recoveries' and commits' durations observed as they end; consumer
groups' committed positions and lag from ``kera.metrics.lag``."""

from __future__ import annotations

import trio

from .endpoint import Metrics
from .families import Collector
from .lag import GroupLag, OpenLog

RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class CoordinatorMetrics(Metrics):
    def __init__(self, coord, lag_interval: float, top_groups: int, open_log: OpenLog):
        super().__init__("coordinator")
        self.coord = coord
        self.commit = self.histogram("metadata_commit_seconds", "Duration of a metadata commit")
        self.recovery = self.histogram("recovery_seconds", "Duration of a finished recovery",
                                       RECOVERY_BUCKETS)
        self.recoveries = {"done": 0, "failed": 0}
        self.replayed = self.repointed = 0
        self.lag = GroupLag(coord, lag_interval, top_groups, open_log)
        self.time_rpcs(coord)
        self.registry.register(Collector("kera_", self._fill))

    def recovery_ended(self, rec, ok: bool) -> None:
        """A recovery attempt ended (``RecoveryManager``)."""
        self.recoveries["done" if ok else "failed"] += 1
        if ok:
            self.recovery.observe(rec.describe()["seconds"])
            self.replayed += rec.bytes
            self.repointed += rec.adopted_bytes

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            await n.start(self.serve, host, port)
            n.start_soon(self.lag.run)
            task_status.started()

    def _fill(self, f) -> None:
        c = self.coord
        p = "coordinator_"
        f.gauge(p + "leader", "1 on the leading coordinator, 0 on a standby", 1 if c.leading else 0)
        f.gauge(p + "members", "Registered brokers and backups", labels=["role", "state"], samples=[
            ((role, state), sum(1 for m in c.roster.members[role].values() if m.alive == (state == "alive")))
            for role in ("broker", "backup") for state in ("alive", "dead")])
        f.gauge(p + "streams", "Streams", len(c.metadata.streams))
        active = [r for r in c.recovery.active.values()]
        f.gauge(p + "recoveries_in_progress", "Recoveries under way", len(active))
        f.gauge(p + "recoveries_waiting", "Recoveries waiting for backups", len(c.recovery.waiting))
        f.counter(p + "recoveries", "Recovery attempts ended", labels=["outcome"],
                  samples=[((k,), v) for k, v in self.recoveries.items()])
        f.counter(p + "recovery_replayed_bytes", "Bytes replayed by finished recoveries", self.replayed)
        f.counter(p + "recovery_repointed_bytes", "Bytes re-pointed (adopted from backups' copies, "
                  "not replayed) by finished recoveries", self.repointed)
        f.counter(p + "terms", "Terms this coordinator led", c.terms)
        self.lag.fill(f)
