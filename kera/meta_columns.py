"""A page of streams' metadata as columns: the ``metadata`` answer a client asks ``columns`` of.

As maps, one per stream, a page of 1,024 streams costs its reader about 12 us a
stream: msgpack builds every key and value of every map, then each map is checked
and typed (``StreamMeta.from_wire``); a producer meeting 100,000 new streams spent
1.2 s of its 2.8 s there. As columns the page is a few arrays whatever its size:
the integer settings one int64 matrix (``INTS``, a row per stream), the creation
times one float64 array, each streamlet's owner an index into the page's few
incarnations (``members``: broker, epoch and address, None while it is not
alive), and what is rare (a string setting other than its default, the two
nullable settings, keys of a newer writer) sparse, by row. A reader checks the
page with a handful of array comparisons (``decode``: ``ProtocolError`` on any
misfit) and keeps the arrays; ``view(i)`` makes one stream's ``StreamView`` for
callers that want one, and the producer and consumer read the columns directly.

The coordinator makes a page from *rows* (``row``: a stream's integers and
creation time packed, then the owner of each streamlet), kept per usual stream
by its catalog: joined and read as arrays, a page of 1,024 costs it about
0.85 us a stream, where decoding the stored maps first cost about 2.9.
"""

from __future__ import annotations

import struct
from operator import itemgetter

import numpy as np

from .errors import ProtocolError
from .stream_meta import StreamMeta

# the integer settings every stream map holds, in the matrix's column order
INTS = ("id", "streamlets", "groups", "replication", "segment_size", "group_segments",
        "retention_bytes", "retention_ms")
_ROW = itemgetter(*INTS)
_ROW_DEFAULTS = {"retention_bytes": -1, "retention_ms": -1}   # maps written before retention
# settings left out of the columns when they have these values (``rare`` holds the others)
_RARE = {"vlogs": None, "cleanup_policy": "delete", "delete_retention_ms": None, "segment_ms": None}
_KNOWN = frozenset((*INTS, *_RARE, "name", "owners", "created"))
ID, STREAMLETS, SEGMENT_SIZE = INTS.index("id"), INTS.index("streamlets"), INTS.index("segment_size")


_FIXED = struct.Struct(f"<{len(INTS)}qd")   # a page row's INTS and creation time
_OWNER = struct.Struct("<2q")                  # then (broker, epoch) per streamlet
_PAIR = _OWNER.size
_ONE = struct.Struct(_FIXED.format + "2q")     # the row of a stream of one streamlet
_FIXED_DTYPE = np.dtype([("ints", "<i8", (len(INTS),)), ("created", "<f8")])
_PLAIN_KEYS = frozenset((*INTS, "name", "owners", "created", "vlogs", "cleanup_policy"))
_USUAL = len(_PLAIN_KEYS)


def row(d: dict) -> tuple[bytes, dict]:
    """Stream map ``d`` as a page row (bytes: its ``INTS`` and creation time, then the
    (broker, epoch) owning each streamlet) and its rare settings (empty for a usual map).
    The coordinator keeps the rows of usual maps, so a page of them is joined, not decoded
    (``encode_rows``)."""
    try:
        ints = _ROW(d)
    except KeyError:   # maps written before some settings were kept
        ints = tuple(d.get(k, _ROW_DEFAULTS.get(k)) for k in INTS)
    owners = d["owners"]
    if len(owners) == 1:
        b = _ONE.pack(*ints, d.get("created", 0.0), *owners[0])
    else:
        b = _FIXED.pack(*ints, d.get("created", 0.0)) + b"".join([_OWNER.pack(*o) for o in owners])
    if len(d) == _USUAL and d.get("vlogs", 0) is None and d.get("cleanup_policy") == "delete" \
            and d.keys() == _PLAIN_KEYS:
        return b, {}
    odd = {k: d[k] for k, v in _RARE.items() if k in d and d[k] != v}   # off its default
    odd.update((k, v) for k, v in d.items() if k not in _KNOWN)          # keys of another shape
    return b, odd


def width(r: bytes) -> int:
    """The streamlets of a page row."""
    return (len(r) - _FIXED.size) // _PAIR


def with_owner(r: bytes, i: int, owner) -> bytes:
    """Page row ``r`` with streamlet ``i`` owned by ``owner`` (broker, epoch)."""
    at = _FIXED.size + _PAIR * i
    return r[:at] + _OWNER.pack(*owner) + r[at + _PAIR:]


def encode_rows(names: list[str], rows: list[bytes], rare: dict[int, dict], addr_of) -> dict:
    """The columns of a page of streams given as ``row``s (``rare``: row -> its rare
    settings); ``addr_of(broker, epoch)``: the address of that incarnation if it is alive,
    else None. Joins and a few array operations, nothing per stream but two slices."""
    w = _FIXED.size
    fixed = np.frombuffer(b"".join([r[:w] for r in rows]), _FIXED_DTYPE)
    pairs = np.frombuffer(b"".join([r[w:] for r in rows]), "<i8").reshape(-1, 2)
    if len(pairs):
        held, which = np.unique(pairs, axis=0, return_inverse=True)
    else:
        held, which = pairs, np.zeros(0, np.int64)
    return {"names": names, "ints": fixed["ints"].tobytes(), "created": fixed["created"].tobytes(),
            "owners": which.reshape(-1).astype("<u4").tobytes(),
            "members": [[b, e, addr_of(b, e)] for b, e in held.tolist()], "rare": rare}


def encode(maps: list[dict], addr_of) -> dict:
    """The columns of stream maps (``encode_rows`` of their ``row``s)."""
    rows, rare = [], {}
    for i, d in enumerate(maps):
        r, odd = row(d)
        rows.append(r)
        if odd:
            rare[i] = odd
    return encode_rows([d["name"] for d in maps], rows, rare, addr_of)


class Columns:
    """One page of streams (``decode``): ``names``, the ``ints`` matrix (a row per stream,
    columns ``INTS``), ``created``, ``first[i]`` (stream i's first streamlet in the
    per-streamlet ``owner`` array), ``owner`` (per streamlet, an index into ``members``:
    ((broker, epoch), address or None)) and ``rare`` (row -> its other settings)."""

    __slots__ = ("names", "ints", "created", "first", "owner", "members", "rare")

    def __init__(self, names, ints, created, first, owner, members, rare):
        self.names, self.ints, self.created, self.first, self.owner, self.members, self.rare = \
            names, ints, created, first, owner, members, rare

    def __len__(self) -> int:
        return len(self.names)

    @property
    def ids(self) -> np.ndarray:
        return self.ints[:, ID]

    @property
    def streamlets(self) -> np.ndarray:
        return self.ints[:, STREAMLETS]

    @property
    def segment_sizes(self) -> np.ndarray:
        return self.ints[:, SEGMENT_SIZE]

    def routes(self) -> tuple[list, list]:
        """Per stream, the tuple of its streamlets' owners' addresses (None: not alive) and
        the tuple of those owners ((broker, epoch)): one list comprehension per page (a
        stream of one streamlet, the common case, costs one indexing)."""
        addr = [a for _, a in self.members]
        who = [o for o, _ in self.members]
        own = self.owner.tolist()
        if len(own) == len(self.names):   # one streamlet each: a tuple per member, shared
            one_addr, one_who = [(a,) for a in addr], [(o,) for o in who]
            return [one_addr[k] for k in own], [one_who[k] for k in own]
        first = self.first.tolist()
        spans = [own[a:b] for a, b in zip(first, first[1:], strict=False)]
        return ([tuple([addr[k] for k in s]) for s in spans],
                [tuple([who[k] for k in s]) for s in spans])

    def view(self, i: int, view_class=StreamMeta):
        """Stream ``i`` as a ``view_class`` (a ``StreamView`` is given its addresses). A row with
        rare settings goes through ``from_wire``, which checks their types."""
        r = self.ints[i].tolist()
        a, b = int(self.first[i]), int(self.first[i + 1])
        mine = [self.members[k] for k in self.owner[a:b].tolist()]
        owners = tuple(o for o, _ in mine)
        rare = self.rare.get(i)
        if rare:
            d = dict(zip(INTS, r, strict=True), name=self.names[i], owners=[list(o) for o in owners],
                     created=float(self.created[i]), **rare)
            if view_class is not StreamMeta:
                d["addrs"] = [x for _, x in mine]
            return view_class.from_wire(d)
        args = [self.names[i], r[0], r[1], r[2], r[3], r[4], r[5], owners, None, r[6], r[7],
                "delete", None, None, float(self.created[i]), None]
        if view_class is not StreamMeta:
            args.append(tuple(x for _, x in mine))
        return view_class(*args)

    def views(self, view_class=StreamMeta) -> list:
        """Every stream's ``view``, made from whole columns (lists, not a numpy row each)."""
        addrs, owners = self.routes()
        rare, more = self.rare, view_class is not StreamMeta
        out = []
        for i, (name, r, made, own, at) in enumerate(zip(self.names, self.ints.tolist(),
                                                         self.created.tolist(), owners, addrs,
                                                         strict=True)):
            if rare and i in rare:
                out.append(self.view(i, view_class))
            elif more:
                out.append(view_class(name, r[0], r[1], r[2], r[3], r[4], r[5], own, None, r[6],
                                      r[7], "delete", None, None, made, None, at))
            else:
                out.append(view_class(name, r[0], r[1], r[2], r[3], r[4], r[5], own, None, r[6],
                                      r[7], "delete", None, None, made, None))
        return out


def _bad(what: str) -> ProtocolError:
    return ProtocolError(f"metadata columns: {what}")


def decode(d) -> Columns:
    """The columns of an answer's ``columns`` map, checked whole: ``ProtocolError`` unless
    every column is there, of its type and length, every count and index in range."""
    if type(d) is not dict:
        raise _bad("not a map")
    names, ints, created, owners, members, rare = (d.get(k) for k in (
        "names", "ints", "created", "owners", "members", "rare"))
    if type(names) is not list or not all(type(x) is str for x in names):
        raise _bad("names must be a list of strings")
    n = len(names)
    if not all(type(b) is bytes for b in (ints, created, owners)) or len(ints) != 8 * n * len(INTS) \
            or len(created) != 8 * n or len(owners) % 4:
        raise _bad("ints, created and owners must be arrays of a row per stream")
    m = np.frombuffer(ints, "<i8").reshape(n, len(INTS))
    count = m[:, STREAMLETS]
    first = np.zeros(n + 1, np.int64)
    np.cumsum(count, out=first[1:])
    owner = np.frombuffer(owners, "<u4")
    if n and (int(count.min()) < 1 or int(first[-1]) != len(owner) or (m[:, SEGMENT_SIZE] < 1).any()):
        raise _bad("streamlet counts disagree with the owners")
    if type(members) is not list or not all(
            type(x) is list and len(x) == 3 and type(x[0]) is int and type(x[1]) is int
            and (x[2] is None or type(x[2]) is str) for x in members):
        raise _bad("members must be [broker, epoch, address or null]")
    if len(owner) and int(owner.max()) >= len(members):
        raise _bad("an owner names no member")
    if type(rare) is not dict or not all(type(k) is int and 0 <= k < n and type(v) is dict
                                         for k, v in rare.items()):
        raise _bad("rare must map rows to settings")
    return Columns(names, m, np.frombuffer(created, "<f8"), first, owner,
                   [((b, e), a) for b, e, a in members], rare)


def from_views(views: list) -> Columns:
    """Columns of ``StreamView``s (an older coordinator's answer of maps)."""
    maps = [v.to_wire() for v in views]
    live = {}
    for v in views:
        live.update(zip(v.owners, v.addrs, strict=True))
    return decode(encode(maps, lambda b, e: live.get((b, e))))
