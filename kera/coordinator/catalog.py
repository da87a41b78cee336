"""The coordinator's streams: their maps as the store keeps them, their names in order, their
ids and owners indexed.

A million streams must fit a coordinator: as dicts (the store's map plus a
``StreamMeta`` per stream) they cost several KiB each. Here a stream is the
msgpack bytes of its map, as the metadata store holds and writes it (a
*packed* entry, ``kera.coordinator.metalog``), decoded into a ``StreamMeta`` only when a
request needs that stream; beside it, per stream, a slot in the name index,
the id index and the holdings (``kera.recovery.holdings``), and the stream's page
row (``entries``): a few hundred bytes in all.

Nothing here walks every stream but the loading: a page of a listing starts
with a binary search in the sorted names (re-sorted only after creates or
deletes), a pattern with a literal prefix (``orders-*``) scans only the names
under that prefix, and any other pattern scans at most ``limits.MAX_LIST_SCAN``
names per page and says where to go on.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator

from .. import limits, meta_columns
from ..names import is_internal
from ..recovery.holdings import Holdings
from ..stream_meta import Owner, StreamMeta
from .metalog import pack, unpack

_WILD = re.compile(r"[*?\[]")
_NIL = b"\xc0"                  # msgpack's nil: an unknown name's place in ``wires``
_ARRAY32 = struct.Struct(">BI")  # msgpack's array 32 header


def literal_prefix(pattern: str | None) -> str:
    """The part of ``pattern`` before its first wildcard: every match starts with it."""
    if pattern is None:
        return ""
    m = _WILD.search(pattern)
    return pattern if m is None else pattern[:m.start()]


class NameIndex:
    """Names in order. Names added since the last scan are merged in at the next one: in
    place one by one if they are few, else by one sort of two sorted runs (linear)."""

    def __init__(self, names: Iterable[str] = ()):
        self._sorted = sorted(names)
        self._added: list[str] = []

    def add(self, name: str) -> None:
        self._added.append(name)

    def discard(self, name: str) -> None:
        self._merge()
        i = bisect.bisect_left(self._sorted, name)
        if i < len(self._sorted) and self._sorted[i] == name:
            del self._sorted[i]

    def __len__(self) -> int:
        return len(self._sorted) + len(self._added)

    def _merge(self) -> None:
        added, names = self._added, self._sorted
        if not added:
            return
        added.sort()
        if not names or added[0] > names[-1]:
            names += added
        elif len(added) <= 64:
            for n in added:
                bisect.insort(names, n)
        else:
            names += added
            names.sort()
        self._added = []

    def scan(self, pattern: str | None = None, after: str | None = None) -> Iterator[tuple[str, bool]]:
        """(name, matches) in name order, from just after ``after``, over the names that can
        match ``pattern`` (all with its literal prefix); a caller stops when it has enough."""
        self._merge()
        names = self._sorted
        prefix = literal_prefix(pattern)
        start = max(after or "", prefix)
        i = bisect.bisect_right(names, start) if after is not None and start == after \
            else bisect.bisect_left(names, start)
        exact = pattern is not None and prefix == pattern
        every = pattern is None or pattern == prefix + "*"   # all the names under the prefix
        for j in range(i, len(names)):
            name = names[j]
            if not name.startswith(prefix):
                return
            yield name, every or (name == pattern if exact else fnmatch.fnmatchcase(name, pattern))


class Page:
    """The streams of one metadata or list answer: at most ``limit`` of them and
    ``MAX_LIST_PAGE_STREAMLETS`` streamlets (its first stream always fits)."""

    def __init__(self, limit: int = limits.MAX_LIST_PAGE):
        self.limit = limit
        self.streams: list[dict] = []
        self.streamlets = 0

    def fits(self, streamlets: int) -> bool:
        return not self.streams or (len(self.streams) < self.limit and
                                    self.streamlets + streamlets <= limits.MAX_LIST_PAGE_STREAMLETS)

    def add(self, entry, streamlets: int) -> None:
        self.streams.append(entry)
        self.streamlets += streamlets


class Catalog:
    """The streams of ``store`` (a ``MetaLog`` or ``EtcdMeta`` whose ``streams`` map is
    packed): every change to a stream goes through here, so the indexes stay in step."""

    def __init__(self, store):
        self.store = store
        self._maps: dict[str, bytes] = store.state["streams"]
        self.holdings = Holdings()                 # incarnation -> streamlets
        self.names = NameIndex(n for n in self._maps if not is_internal(n))   # listed, in order
        pairs = []
        for name, b in self._maps.items():
            d = unpack(b)
            pairs.append((d["id"], name))
            self.holdings.add(name, d["owners"])
        pairs.sort()
        self._ids = array("q", [i for i, _ in pairs])   # ascending, beside the names they are
        self._id_names = [n for _, n in pairs]
        # alters so far, and the last one of each stream altered: a recovery's hand-over
        # resends the maps of those altered since its assign, and names the others by id
        self.alters = 0
        self._altered: dict[str, int] = {}
        self._rows: dict[str, bytes] = {}   # name -> page row of a usual stream (``entries``)

    def __len__(self) -> int:
        return len(self._maps)

    def __contains__(self, name) -> bool:
        return name in self._maps

    def __iter__(self) -> Iterator[str]:
        return iter(self._maps)

    def get(self, name) -> StreamMeta | None:
        b = self._maps.get(name) if isinstance(name, str) else None
        return None if b is None else StreamMeta.from_wire(unpack(b))

    def __getitem__(self, name) -> StreamMeta:
        s = self.get(name)
        if s is None:
            raise KeyError(name)
        return s

    def wire(self, name: str) -> dict | None:
        """The stream's map as stored (a fresh dict, the caller's to change), None if none."""
        b = self._maps.get(name)
        return None if b is None else unpack(b)

    def entries(self, names: list[str], columns: bool, describe: Callable[[dict], dict]) -> list:
        """Per name, None if no such stream, else (what a page holds of it, its streamlets):
        with ``columns`` (name, its ``meta_columns.row``, its rare settings), else
        ``describe(map)``. The rows of usual streams are kept (``_rows``: made at their
        creation, or from their maps the first time they are asked for; patched when an
        owner moves, dropped when altered or deleted), so a page of them is decoded from
        nothing: decoding the maps was two thirds of the coordinator's work answering a
        million streams' lookups."""
        if not columns:
            return [None if d is None else (describe(d), d["streamlets"]) for d in self.wires(names)]
        rows = self._rows
        out = [None if r is None else (n, r, None) for n, r in zip(names, map(rows.get, names),
                                                                   strict=True)]
        miss = [k for k, e in enumerate(out) if e is None]
        for k, d in zip(miss, self.wires([names[k] for k in miss]) if miss else (), strict=True):
            if d is not None:
                r, odd = meta_columns.row(d)
                if not odd:
                    rows[names[k]] = r
                out[k] = (names[k], r, odd or None)
        return [None if e is None else (e, meta_columns.width(e[1])) for e in out]

    def wires(self, names: list[str]) -> list[dict | None]:
        """``wire`` of each name, decoded in one call (a page of a producer's lookup: one
        decoder call per stream cost a third of the coordinator's work answering them)."""
        got = self._maps.get
        blobs = [got(n, _NIL) for n in names]
        return unpack(_ARRAY32.pack(0xdd, len(blobs)) + b"".join(blobs))

    def created_after(self, sid: int) -> Iterator[tuple[int, str]]:
        """(id, name) of the streams whose id is above ``sid`` (created since), in id order."""
        ids, names = self._ids, self._id_names
        for k in range(bisect.bisect_right(ids, sid), len(ids)):
            yield ids[k], names[k]

    def by_id(self, sid: int) -> StreamMeta | None:
        k = bisect.bisect_left(self._ids, sid)
        if k < len(self._ids) and self._ids[k] == sid:
            return self.get(self._id_names[k])
        return None

    # -- pages -----------------------------------------------------------------------------
    def listing(self, page: Page, describe: Callable[[dict], dict], pattern: str | None,
                after: str | None, skip=(), visible=None, columns: bool = False) -> str | None:
        """Add the listed streams matching ``pattern`` (all if None), in name order from just
        after ``after``, to ``page`` while it has room (as ``entries`` gives them); returns
        the ``after`` of the rest, None if none is left. ``visible(name)``: whether the
        caller may see it (all if None)."""
        return self._fill(page, describe, after, ((name, name, match and name not in skip)
                                                  for name, match in self.names.scan(pattern, after)),
                          visible, columns)

    def created(self, page: Page, describe: Callable[[dict], dict], pattern: str,
                since: int, visible=None, columns: bool = False) -> int | None:
        """``listing`` of the streams created after id ``since``, in id order; returns the
        ``since`` of the rest, None if none is left."""
        return self._fill(page, describe, since, (
            (sid, name, not is_internal(name) and fnmatch.fnmatchcase(name, pattern))
            for sid, name in self.created_after(since)), visible, columns)

    def _fill(self, page: Page, describe, start, items, visible=None, columns: bool = False):
        """``items``: (cursor, name, wanted) in order; at most ``MAX_LIST_SCAN`` are looked at.
        Returns the cursor to go on from, None once ``items`` is exhausted. The page's
        ``entries`` are made together once its names are known."""
        room = page.limit - len(page.streams)
        names: list = []    # (the cursor before it, name) of the streams for this page
        last, scanned, rest = start, 0, None
        for cursor, name, wanted in items:
            if wanted and (visible is None or visible(name)):
                if len(names) == room:
                    rest = last
                    break
                names.append((last, name))
            last = cursor
            scanned += 1
            if scanned == limits.MAX_LIST_SCAN:
                rest = cursor
                break
        for (before, _), (entry, width) in zip(names, self.entries([n for _, n in names], columns,
                                                                   describe), strict=True):
            if not page.fits(width):
                return before
            page.add(entry, width)
        return rest

    # -- changes (each recorded in the store) ----------------------------------------------
    def create(self, s: StreamMeta, listed: bool = True) -> None:
        """A new stream; ``listed``: a user's (kera's internal streams are not listed)."""
        d = s.to_wire()
        self.store.set(("streams", s.name), pack(d))
        r, odd = meta_columns.row(d)
        if not odd:
            self._rows[s.name] = r
        self.holdings.add(s.name, s.owners)
        if listed:
            self.names.add(s.name)
        if not self._ids or s.id > self._ids[-1]:
            self._ids.append(s.id)
            self._id_names.append(s.name)
        else:
            k = bisect.bisect_left(self._ids, s.id)
            self._ids.insert(k, s.id)
            self._id_names.insert(k, s.name)

    def owned(self, name: str, sid: int, i: int, owner: Owner) -> bool:
        """Whether streamlet ``i`` of stream ``name`` (id ``sid``) is ``owner``'s, from the
        indexes (no map decoded)."""
        k = bisect.bisect_left(self._ids, sid)
        return (k < len(self._ids) and self._ids[k] == sid and self._id_names[k] == name
                and self.holdings.holds(owner, name, i))

    def set_owner(self, name: str, i: int, old: Owner, owner: Owner) -> None:
        """Streamlet ``i`` of stream ``name``, served by ``old`` now, is served by ``owner``
        (a recovery hands over a third of a million at once: no stream is decoded here)."""
        self.store.set(("streams", name, "owners", i), list(owner))
        r = self._rows.get(name)
        if r is not None:
            self._rows[name] = meta_columns.with_owner(r, i, owner)
        self.holdings.move(name, i, old, owner)

    def alter(self, s: StreamMeta, changes: dict) -> StreamMeta:
        self.alters += 1
        self._altered[s.name] = self.alters
        for key, v in changes.items():
            self.store.set(("streams", s.name, key), v)
        self._rows.pop(s.name, None)
        return s.altered(changes)

    def altered_since(self, name: str, mark: int) -> bool:
        """Whether stream ``name`` was altered after ``alters`` was ``mark``."""
        return self._altered.get(name, 0) > mark

    def delete(self, s: StreamMeta) -> None:
        self._altered.pop(s.name, None)
        self.store.delete(("streams", s.name))
        self._rows.pop(s.name, None)
        self.holdings.remove(s.name, s.owners)
        self.names.discard(s.name)
        k = bisect.bisect_left(self._ids, s.id)
        if k < len(self._ids) and self._ids[k] == s.id:
            del self._ids[k], self._id_names[k]
