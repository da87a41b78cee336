"""Backup service: replicas of brokers' virtual segments, in memory then on disk.

- ``segment_file``: the on-disk format (header, chunks as on the wire, closing
  trailer) and its verifying loader (torn tails cut, corrupt chunks reported).
- ``replica``: one replica's bookkeeping (in-memory blocks, chunk index, flush marks).
- ``service``: ``BackupService`` (RPCs replicate/list/read/drop/stats) and ``main``.
- ``membership``: the backup's id on disk, registration and heartbeats.

``service`` is not imported here so ``python -m kera.backup.service`` runs cleanly.
"""
