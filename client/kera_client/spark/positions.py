"""Offsets of the ``kera`` Spark source: pure arithmetic on group positions.

A *position vector* says how far one streamlet was read: ``(low, {group: pos})``,
exactly the consumer's ``{"low", "groups"}`` (kera_client/consumer.py). Groups
below ``low`` are read to their end, a group absent from the dict is at its
start (0), and ``pos`` packs ``segment << 32 | offset`` or is ``DONE`` (-1)
once a closed group was read to its end. Positions are monotonic inside a
group and DONE is past every position, so "how far" compares with ``order``.

The same vector serves as a lower bound (where a micro-batch starts) and as
an upper bound (where it ends): the records of a batch are, for every group,
the chunks placed at ``start <= position < end``. The broker's ``offsets``
RPC gives the durable end of each group, i.e. the latest possible end.

Offsets as Spark checkpoints them (JSON, keys sorted, so equal offsets are
equal strings)::

    {"streams":   {"<name>": <stream id>, ...},
     "positions": {"<name>/<streamlet>": {"low": L, "groups": {"<group>": pos}}, ...}}

``streams`` lists every stream the query covers (the id tells a re-created
stream from the old one); a streamlet absent from ``positions`` is at its
start. Nothing here does I/O; everything is tested without a cluster.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field

from kera.position import DONE, pack, unpack

Vector = tuple  # (low: int, groups: dict[int, int])
START: Vector = (0, {})


def order(pos: int) -> float:
    """Sort key of a position inside a group: DONE is past everything."""
    return math.inf if pos == DONE else pos


def pos_of(v: Vector, group: int) -> int:
    low, groups = v
    return DONE if group < low else groups.get(group, 0)


def compact(low: int, groups: dict) -> Vector:
    """Canonical form: leading DONE groups folded into ``low``, zeros and groups below low dropped."""
    g = {int(k): int(p) for k, p in groups.items() if int(k) >= low and int(p) != 0}
    while g.get(low) == DONE:
        del g[low]
        low += 1
    return low, g


def merge_max(a: Vector, b: Vector) -> Vector:
    """Per group, the further of two vectors (so offsets never go backwards)."""
    low = max(a[0], b[0])
    groups = {}
    for gid in set(a[1]) | set(b[1]):
        if gid >= low:
            pa, pb = pos_of(a, gid), pos_of(b, gid)
            groups[gid] = pa if order(pa) >= order(pb) else pb
    return compact(low, groups)


def work(start: Vector, end: Vector) -> dict[int, tuple[int, int]]:
    """Groups with records between two vectors: ``{group: (from, to)}``."""
    out = {}
    for gid in set(range(start[0], end[0])) | set(end[1]):
        s, e = pos_of(start, gid), pos_of(end, gid)
        if order(s) < order(e):
            out[gid] = (s, e)
    return out


# -- offsets as JSON ----------------------------------------------------------------

@dataclass
class Offsets:
    """Positions of every streamlet of the streams a query covers."""

    streams: dict[str, int] = field(default_factory=dict)         # name -> stream id
    positions: dict[tuple[str, int], Vector] = field(default_factory=dict)

    def get(self, name: str, streamlet: int) -> Vector:
        return self.positions.get((name, streamlet), START)

    def to_json(self) -> dict:
        pos = {}
        for (name, i) in sorted(self.positions):
            low, groups = compact(*self.positions[(name, i)])
            if low or groups:
                pos[f"{name}/{i}"] = {"low": low, "groups": {str(g): groups[g] for g in sorted(groups)}}
        return {"streams": {n: self.streams[n] for n in sorted(self.streams)}, "positions": pos}

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, obj) -> Offsets:
        """Our own format, or a consumer's ``position()`` dict (``{"name/i": {...}}``) alone."""
        if isinstance(obj, str):
            obj = json.loads(obj)
        if not isinstance(obj, dict):
            raise ValueError("kera offsets must be a JSON object")
        if "positions" in obj or "streams" in obj:
            streams = {str(k): int(v) for k, v in (obj.get("streams") or {}).items()}
            raw = obj.get("positions") or {}
        else:
            streams, raw = {}, obj
        positions = {}
        for key, p in raw.items():
            name, sep, idx = str(key).rpartition("/")
            if not sep or not idx.isdigit() or not isinstance(p, dict):
                raise ValueError(f"bad kera position {key!r}: want 'stream/streamlet': "
                                 "{'low': L, 'groups': {'group': pos}}")
            positions[(name, int(idx))] = compact(int(p.get("low", 0)), p.get("groups") or {})
        return cls(streams, positions)

    def rebased(self, streams: dict[str, int]) -> Offsets:
        """These positions for ``streams`` (name -> id): streams re-created under the
        same name, or unknown here, start at their beginning."""
        pos = {(n, i): v for (n, i), v in self.positions.items()
               if n in streams and self.streams.get(n, streams[n]) == streams[n]}
        return Offsets(dict(streams), pos)


# -- sizes: bytes between positions ---------------------------------------------------

def span_bytes(s: int, e: int, segment_size: int, group_segments: int) -> int:
    """Approximate bytes of chunks between two positions of one group.

    Exact inside a segment; across segments every segment is counted full
    (a segment closes when the next chunk does not fit, so at most one chunk
    less); a closed group (DONE) is counted as its G full segments.
    """
    if s == DONE or order(s) >= order(e):
        return 0
    ss, so = unpack(s)
    if e == DONE:
        es, eo = group_segments, 0
    else:
        es, eo = unpack(e)
    return max(1, (es - ss) * segment_size + eo - so)


def cut_points(s: int, e: int) -> list[int]:
    """Positions strictly between ``s`` and ``e`` where a batch may end: segment starts.

    A chunk never spans segments, so ``segment << 32 | 0`` is always a chunk
    boundary; only segments that exist (up to ``e``'s) are used. A range that
    ends at DONE is not cut (the number of segments of a closed group is not
    known from positions alone).
    """
    if e == DONE or s == DONE:
        return []
    return [pack(k, 0) for k in range(unpack(s)[0] + 1, unpack(e)[0] + 1)
            if order(s) < pack(k, 0) < order(e)]


@dataclass
class GroupRange:
    """Records of one group to read: ``start <= position < end``."""

    group: int
    start: int
    end: int
    nbytes: int


@dataclass
class StreamletRange:
    """One streamlet's share of a micro-batch (one or more of its groups)."""

    stream: str
    stream_id: int
    streamlet: int
    groups: list[GroupRange]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def to_wire(self) -> tuple:
        return (self.stream, self.stream_id, self.streamlet,
                tuple((g.group, g.start, g.end) for g in self.groups), self.nbytes)


def ranges(start: Offsets, end: Offsets, meta: dict[str, dict]) -> list[StreamletRange]:
    """Everything between two offsets, per streamlet, with approximate sizes.

    ``meta`` maps stream names to their description (``segment_size``,
    ``group_segments``, ``id``); streams absent from it or from ``end`` are skipped.
    """
    start = start.rebased(end.streams)
    out = []
    for name in sorted(end.streams):
        m = meta.get(name)
        if m is None or m.id != end.streams[name]:
            continue
        for i in range(m.streamlets):
            w = work(start.get(name, i), end.get(name, i))
            if w:
                gs = [GroupRange(g, s, e, span_bytes(s, e, m.segment_size, m.group_segments))
                      for g, (s, e) in sorted(w.items())]
                out.append(StreamletRange(name, m.id, i, gs))
    return out


# -- admission control ------------------------------------------------------------------

def advance(pos: int, nbytes: int, segment_size: int) -> int:
    """The position ``nbytes`` after ``pos`` if segments were full (a target, maybe mid-chunk)."""
    seg, off = unpack(pos)
    while nbytes >= segment_size - off:
        nbytes -= segment_size - off
        seg, off = seg + 1, 0
    return pack(seg, off + nbytes)


@dataclass
class Cut:
    """A group that ends a batch inside its range: ``target`` must be moved to a chunk boundary."""

    stream: str
    streamlet: int
    group: int
    start: int
    target: int
    end: int


def admit(start: Offsets, latest: Offsets, meta: dict[str, dict], budget: float, turn: int = 0,
          chunk_bytes: float = 16384, max_cuts: int = 64) -> tuple[Offsets, list[Cut]]:
    """An end offset between ``start`` and ``latest`` holding about ``budget`` bytes.

    Water-filling over the streamlets with records: those whose backlog is
    below the fair share go whole; the budget left is split evenly over at
    most ``max_cuts`` of the larger ones (fewer if the budget holds fewer
    chunks), chosen round-robin by ``turn`` so none starves. Inside a
    streamlet, groups are taken in id order and only the last one taken may
    be cut, so a producer's records (which move to higher groups only)
    arrive in order across micro-batches too. A cut group ends at a byte
    *target*; the caller moves it to the next chunk boundary (``Cut``) and
    calls ``apply_cuts``. Every batch progresses: a cut is at least one chunk.
    """
    if budget == math.inf:
        return latest, []
    start = start.rebased(latest.streams)
    items = ranges(start, latest, meta)
    if sum(r.nbytes for r in items) <= budget:
        return latest, []
    items.sort(key=lambda r: (r.nbytes, r.stream, r.streamlet))
    left = float(budget)
    whole, rest = [], []
    for k, r in enumerate(items):
        if r.nbytes * (len(items) - k) <= left:
            whole.append(r)
            left -= r.nbytes
        else:
            rest = items[k:]
            break
    rest.sort(key=lambda r: (r.stream, r.streamlet))
    n = int(max(1, min(max_cuts, len(rest), left // max(1.0, chunk_bytes))))
    first = (turn * n) % len(rest)
    chosen = (rest[first:] + rest[:first])[:n]
    share = max(1, int(left / n - chunk_bytes / 2))  # a target rounds up to its chunk's end
    reached: dict[tuple, dict[int, int]] = {}
    cuts = []
    for r in whole:
        reached[(r.stream, r.streamlet)] = {g.group: g.end for g in r.groups}
    for r in chosen:
        got = reached[(r.stream, r.streamlet)] = {}
        room = share
        for g in r.groups:
            if g.nbytes <= room:
                got[g.group] = g.end
                room -= g.nbytes
                continue
            target = advance(g.start, max(1, room), meta[r.stream].segment_size)
            if order(target) >= order(g.end) or \
                    (g.end == DONE and unpack(target)[0] >= meta[r.stream].group_segments):
                got[g.group] = g.end
            else:
                got[g.group] = target
                cuts.append(Cut(r.stream, r.streamlet, g.group, g.start, target, g.end))
            break
    positions = dict(start.positions)
    for key, gs in reached.items():
        low, groups = start.get(*key)
        positions[key] = compact(low, {**groups, **gs})
    return Offsets(dict(latest.streams), positions), cuts


def aligned_or_fallback(c: Cut, aligned: int | None) -> int:
    """The end position of a cut group: its target moved to a chunk boundary, or (alignment
    impossible) the nearest segment start after ``start``, or the range's end."""
    if aligned is not None and order(c.start) < order(aligned) <= order(c.end):
        return aligned
    seg = unpack(c.target)[0]
    for p in (pack(seg, 0),) if c.end == DONE else (pack(seg, 0), pack(seg + 1, 0)):
        if order(c.start) < p < order(c.end):
            return p  # segment starts are chunk boundaries (of segments that exist)
    return c.end


def apply_cuts(end: Offsets, cuts: list[Cut], aligned: dict[tuple, int | None]) -> Offsets:
    positions = dict(end.positions)
    for c in cuts:
        low, groups = positions[(c.stream, c.streamlet)]
        groups = dict(groups)
        groups[c.group] = aligned_or_fallback(c, aligned.get((c.stream, c.streamlet, c.group)))
        positions[(c.stream, c.streamlet)] = compact(low, groups)
    return Offsets(dict(end.streams), positions)


def estimate_bytes(start: Offsets, end: Offsets, meta: dict[str, dict]) -> int:
    return sum(r.nbytes for r in ranges(start, end, meta))


# -- partition planning ------------------------------------------------------------------

def split(r: StreamletRange, target: int, meta: dict) -> list[StreamletRange]:
    """Cut a streamlet range into pieces of about ``target`` bytes (by group, then by segment)."""
    if r.nbytes <= target:
        return [r]
    m = meta[r.stream]
    pieces: list[GroupRange] = []
    for g in r.groups:
        bounds = [g.start, *cut_points(g.start, g.end), g.end]
        acc_from, acc = bounds[0], 0
        for a, b in zip(bounds, bounds[1:], strict=False):
            acc += span_bytes(a, b, m.segment_size, m.group_segments)
            if acc >= target or b == bounds[-1]:
                pieces.append(GroupRange(g.group, acc_from, b, acc))
                acc_from, acc = b, 0
    out, cur = [], []
    for p in pieces:
        if cur and (sum(x.nbytes for x in cur) + p.nbytes > target
                    or any(x.group == p.group for x in cur)):
            out.append(StreamletRange(r.stream, r.stream_id, r.streamlet, cur))
            cur = []
        cur.append(p)
    if cur:
        out.append(StreamletRange(r.stream, r.stream_id, r.streamlet, cur))
    return out


def plan(rs: list[StreamletRange], meta: dict, partition_bytes: int, min_partitions: int,
         max_partitions: int) -> list[list[StreamletRange]]:
    """Spread ranges over Spark partitions of similar size.

    The partition count is ``total / partition_bytes`` clamped to
    [min_partitions, max_partitions] (and to the number of pieces); ranges
    larger than a partition's share are split by group and segment, then
    pieces go largest first to the least loaded partition.
    """
    if not rs:
        return []
    total = sum(r.nbytes for r in rs)
    n = max(min_partitions, min(max_partitions, -(-total // max(1, partition_bytes))))
    n = max(1, min(n, max_partitions))
    share = max(1, -(-total // n))
    pieces = [p for r in rs for p in split(r, share, meta)]
    n = min(n, len(pieces))
    pieces.sort(key=lambda p: (-p.nbytes, p.stream, p.streamlet))
    heap = [(0, k) for k in range(n)]
    parts: list[list[StreamletRange]] = [[] for _ in range(n)]
    for p in pieces:
        load, k = heapq.heappop(heap)
        parts[k].append(p)
        heapq.heappush(heap, (load + p.nbytes, k))
    return [sorted(p, key=lambda r: (r.stream, r.streamlet)) for p in parts if p]
