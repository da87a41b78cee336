"""Replicated virtual logs: chunk references of many streamlets, replicated together (sans-IO).

- ``virtual_log``: ``VirtualLog``, a log of chunk references shared by many streamlets
  (and ``when_all_durable``, one answer once several logs are durable):
  what to send each copy, what an answer means, what is durable; no I/O and no clock
  (the broker's ``Replicator`` and the simulator drive it alike).
- ``virtual_segment``: ``VirtualSegment``, the open/closed unit of a virtual log, and its copies.
- ``placement``: ``BackupSet``, which backups get a virtual segment's copies.
- ``mapping``: ``VlogMapping``, which virtual log a group's chunks go to.

Their names are handed on here.
"""

from .mapping import POLICIES, VlogMapping
from .placement import BackupSet
from .virtual_log import VirtualLog, vlog_epoch, vlog_id, when_all_durable
from .virtual_segment import VirtualSegment

__all__ = ["POLICIES", "BackupSet", "VirtualLog", "VirtualSegment", "VlogMapping", "vlog_epoch", "vlog_id",
           "when_all_durable"]
