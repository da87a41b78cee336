"""The broker: streams -> streamlets -> groups -> segments, all in memory.

- ``service``: ``BrokerService``, the RPC face and the broker's life: what it holds, the
  produce and compare-and-append paths; composed of parts that own their state, each
  handed what it needs: ``membership`` (the incarnation: registration, heartbeats, lease,
  fencing), ``vlogs`` (``VirtualLogs``: the vlogs, live backups, the durable event),
  ``assignment`` (streamlets given and taken away), ``pull`` (consume), ``takeover`` (a
  dead broker's streamlets placed here) and ``reclaim`` (retention, release, eviction);
  ``main``: the command line.
- ``streamlet``: ``Streamlet``, a partition of a stream with up to Q active groups;
  ``sequences``: its producers' sequences (idempotent retries); ``retention``: its oldest
  segments freed; ``ledger``: what the broker keeps over all of them; ``group``: a
  sub-partition of up to G segments; ``segment``: a buffer of back-to-back chunks;
  ``group_close``: a group's close chunk.
- ``replicator``: ``ReplicationHub`` and a ``Replicator`` per virtual log (one replicate
  RPC in flight per backup, for all the vlogs).
- ``memory``: ``MemoryBudget``, the bound on what segments take, and eviction;
  ``tiered``: an evicted segment's chunks read back from a backup's copy.
- ``adopted``: segments taken over from a dead broker as evicted, and the claims that
  keep their files on the backups.
- ``pull_sessions``: readers of many streamlets; ``compactor``: key compaction;
  ``rebuild``: a frozen vseg's lost copies made again from one that survived.
"""
