"""Stream names in order, for listing a page at a time and matching a pattern.

A page of a 100,000-stream listing must not cost a sort of every name: the
sorted list is built once (and again only after a create or a delete) and a
page starts with a binary search. A pattern with a literal prefix (``orders-*``)
scans only the names under that prefix; any other pattern scans at most
``limits.MAX_LIST_SCAN`` names per page and says where to go on.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
from collections.abc import Iterable, Iterator

_WILD = re.compile(r"[*?\[]")


def literal_prefix(pattern: str | None) -> str:
    """The part of ``pattern`` before its first wildcard: every match starts with it."""
    if pattern is None:
        return ""
    m = _WILD.search(pattern)
    return pattern if m is None else pattern[:m.start()]


class NameIndex:
    def __init__(self, names: Iterable[str] = ()):
        self._names = set(names)
        self._sorted: list[str] | None = None

    def add(self, name: str) -> None:
        self._names.add(name)
        self._sorted = None

    def discard(self, name: str) -> None:
        self._names.discard(name)
        self._sorted = None

    def __len__(self) -> int:
        return len(self._names)

    def scan(self, pattern: str | None = None, after: str | None = None) -> Iterator[tuple[str, bool]]:
        """(name, matches) in name order, from just after ``after``, over the names that can
        match ``pattern`` (all with its literal prefix); a caller stops when it has enough."""
        if self._sorted is None:
            self._sorted = sorted(self._names)
        names = self._sorted
        prefix = literal_prefix(pattern)
        start = max(after or "", prefix)
        i = bisect.bisect_right(names, start) if after is not None and start == after \
            else bisect.bisect_left(names, start)
        exact = pattern is not None and prefix == pattern
        for j in range(i, len(names)):
            name = names[j]
            if not name.startswith(prefix):
                return
            yield name, pattern is None or (name == pattern if exact else fnmatch.fnmatchcase(name, pattern))
