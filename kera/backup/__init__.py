"""Backup service: replicas of brokers' virtual segments, in memory then on disk.

- ``service``: ``BackupService``, the RPC face and the backup's life; it composes the parts
  below, each owning its state and handed what it needs of the others.
- ``main``: the process: its command line, run until a signal, then flushed.
- ``store``: ``BackupStore``, the decisions (sans-IO): which replicate is stored,
  acknowledged again or refused, budgets, what a flush writes, reads, drops.
- ``intake``: the replicate path, answered once the bytes are where ``--fsync`` wants them.
- ``flushing``: ``Flusher``, the file work under one I/O lock (files made, written and
  fsynced in rounds, deleted); ``disk``: that work itself, run in threads.
- ``readback``: reads for recovery (read, replay, index) and for evicted segments
  (read_chunks); ``replay``: one replica's chunks pushed to the brokers recovering them.
- ``release``: trims, claims and let-go: which files are deleted, and when;
  ``claims``: ``FileClaims``, which live owners still read a dead incarnation's files.
- ``scrub``: ``Scrubber``, every chunk on disk read back and verified again.
- ``replica``: one replica's bookkeeping (in-memory blocks, chunk index, flush marks).
- ``segment_file``: the on-disk format (header, chunks as on the wire, closing trailer)
  and its verifying loader (torn tails cut, corrupt chunks reported).
- ``membership``: the backup's id on disk, registration and heartbeats.
- ``fields``: the request fields every RPC checks.

Nothing is imported here, so ``python -m kera.backup.main`` runs cleanly.
"""
