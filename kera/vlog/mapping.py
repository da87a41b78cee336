"""Which virtual log a group's chunks go to.

- ``shared`` (default): all groups of a broker spread over V vlogs, each new
  group to the next vlog in turn.
- ``per-stream``: one vlog per stream.
- ``per-group``: one vlog per group: one replicated log per partition, the
  Kafka-like baseline of the paper's comparisons.

Streams of different replication factors never share a vlog. A group always
maps to one vlog, so its chunks are replicated in append order and its
durable part is a prefix.
"""

from __future__ import annotations

from ..stream_meta import StreamMeta

POLICIES = ("shared", "per-stream", "per-group")


class VlogMapping:
    def __init__(self, policy: str = "shared", vlogs: int = 4):
        if policy not in POLICIES:
            raise ValueError(f"vlog policy must be one of {POLICIES}")
        if vlogs < 1:
            raise ValueError("at least one vlog")
        self.policy = policy
        self.vlogs = vlogs
        # the next shared vlog, in turn: a counter, not a map of every group ever placed (the
        # broker caches a group's vlog on the group, so each group asks once)
        self.turn = 0

    def key(self, stream: StreamMeta, streamlet: int, group: int) -> tuple:
        policy = stream.vlogs or self.policy
        r = stream.replication
        if policy == "per-group":
            return (r, "g", stream.id, streamlet, group)
        if policy == "per-stream":
            return (r, "s", stream.id)
        i = self.turn % self.vlogs
        self.turn += 1
        return (r, "v", i)
