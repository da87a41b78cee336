"""Replicated virtual logs: chunk references of many streamlets, replicated together."""

from .mapping import POLICIES, VlogMapping
from .virtual_log import VirtualLog
from .virtual_segment import VirtualSegment

__all__ = ["POLICIES", "VirtualLog", "VirtualSegment", "VlogMapping"]
