"""Replicated virtual logs: chunk references of many streamlets, replicated together."""

from .mapping import POLICIES, VlogMapping
from .placement import BackupSet
from .virtual_log import VirtualLog, vlog_epoch, vlog_id
from .virtual_segment import VirtualSegment

__all__ = ["POLICIES", "BackupSet", "VirtualLog", "VirtualSegment", "VlogMapping", "vlog_epoch", "vlog_id"]
