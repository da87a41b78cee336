"""Backup service: replicas of brokers' virtual segments, in memory then on disk.

- ``segment_file``: the on-disk format (header, chunks as on the wire, closing
  trailer) and its verifying loader (torn tails cut, corrupt chunks reported).
- ``replica``: one replica's bookkeeping (in-memory blocks, chunk index, flush marks).
- ``store``: ``BackupStore``, the decisions (sans-IO): which replicate is stored,
  acknowledged again or refused, budgets, what a flush writes, reads, drops.
- ``disk``: the file work, run in threads (load, flush round, verified read-back).
- ``service``: ``BackupService`` (RPCs replicate/list/fence/stats, the flusher) and ``main``.
- ``readback``: reads for recovery (read, replay, index) and for evicted segments (read_chunks).
- ``release``: trims, claims and let-go: which files are deleted, and when.
- ``fields``: the request fields every RPC checks.
- ``membership``: the backup's id on disk, registration and heartbeats.

``service`` is not imported here so ``python -m kera.backup.service`` runs cleanly.
"""
