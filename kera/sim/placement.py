"""Where the simulated broker puts chunks: streamlets, groups, segments, and which vlog.

The broker's rules on chunk ids instead of bytes: producer ``p`` appends to
active group ``p % Q`` of a streamlet (``Streamlet.append``); the broker's
own ``Group.append`` opens a segment when the last one has no room and
closes the group when its last allowed one has none, its close chunk
(``group_close``) then going to its vlog before the chunk that did not fit,
which opens the next group; a group's vlog is chosen once, by the broker's
own ``VlogMapping``. The memory bound is the real
``MemoryBudget``: a segment's buffer is sized and grown by the broker's own
``Group`` (charged when opened and at each growth), a segment is noted filled
when it takes no more chunks, and evicted by the budget's rule with the broker's own
``Segment.replicated`` (its vsegs closed and done on all copies), which
freezes those vsegs in the real ``VirtualLog``; its background pass
(``MemoryBudget.relieve``) also closes the open vsegs the oldest filled
segments wait in, as on the broker.
"""

from __future__ import annotations

from types import SimpleNamespace

from .. import chunk
from ..broker.group import Group as BrokerGroup
from ..broker.memory import MemoryBudget
from ..broker.segment import Segment as BrokerSegment
from ..errors import BrokerFull
from ..stream_meta import StreamMeta
from ..vlog import VirtualLog
from ..vlog.mapping import VlogMapping

STREAM = 1
CLOSE_SIZE = len(chunk.build(STREAM, 0, 0, 0, [b""], timestamps=0, flags=chunk.CLOSE))


class SimChunk:
    """A chunk as its header places it (a close chunk has no segment: ``seg`` None) and
    where its vlog put it (vseg, byte offset there)."""

    __slots__ = ("cid", "vlog", "durable", "acked_at", "seg", "streamlet", "group", "segment",
                 "offset", "size", "producer", "sequence", "flags", "vseg", "voff")

    def __init__(self, vlog: int, seg, streamlet: int, group: int, segment: int,
                 offset: int, size: int, producer: int, sequence: int, flags: int = 0):
        self.cid, self.vlog, self.seg = -1, vlog, seg
        self.streamlet, self.group, self.segment, self.offset, self.size = \
            streamlet, group, segment, offset, size
        self.producer, self.sequence, self.flags = producer, sequence, flags
        self.durable = 0        # a close chunk's: moved by the vlog (a chunk's is its segment's)
        self.acked_at = None    # time the vlog's durable head passed it
        self.vseg = self.voff = -1

    def __len__(self) -> int:
        return self.size

    def cid_at(self, offset: int) -> int:
        """A close chunk is referenced by the vlog as itself."""
        return self.cid

    def is_durable(self) -> bool:
        """The vlog moved its durable head: its segment's (or, a close chunk, its own)."""
        if self.seg is None:
            return self.durable >= self.size
        return self.seg.durable >= self.offset + self.size


class SimSegment:
    """A broker segment holding chunks, not bytes: the vlog references it (segment, offset,
    length) as the broker's and moves its ``durable``; eviction drops ``buf`` as the broker
    drops the bytes, after which a replicate could not be built from it."""

    __slots__ = ("id", "capacity", "held", "head", "durable", "chunks", "at", "vlog", "vsegs", "vplaces",
                 "buf", "evicted", "filled_at")
    replicated = BrokerSegment.replicated  # the broker's own rule for what may be evicted
    noted = BrokerSegment.noted            # ... and its own record of the vsegs holding its chunks

    def __init__(self, id: int, capacity: int, size: int):
        self.id, self.capacity = id, capacity
        self.held = size   # its buffer's bytes, as the broker's: what the budget charges
        self.head = self.durable = 0
        self.chunks: list[SimChunk] = []
        self.at: dict[int, SimChunk] = {}   # offset -> chunk
        self.vlog = None               # has ``.log``: the VirtualLog, as a broker Replicator
        self.vsegs: list = []          # the distinct vsegs holding its chunks, in order
        self.vplaces: list[int] = []   # per chunk: its vseg and offset there (``noted``)
        self.buf = True
        self.evicted = False
        self.filled_at = 0.0   # > 0 once noted filled (takes no more chunks)

    def room(self) -> int:
        return self.capacity - self.head

    def space(self) -> int:
        return self.held - self.head

    def grow(self, size: int) -> None:
        self.held = size

    def append(self, c: SimChunk) -> int:
        off = c.offset = self.head
        c.seg, c.segment = self, self.id
        self.head += c.size
        self.at[off] = c
        self.chunks.append(c)
        return off

    def cid_at(self, offset: int) -> int | None:
        """The chunk id at ``offset``; None once evicted (its bytes left memory)."""
        return self.at[offset].cid if self.buf is not None else None

    def drop_buffer(self) -> None:
        self.buf = None
        self.held = 0


class SimGroup(BrokerGroup):
    """The broker's group (its ``append`` decides), holding the simulator's segments."""

    def __init__(self, id: int, slot: int, placement: SimPlacement):
        super().__init__(id, slot, placement.segment_size, placement.max_segments, placement.memory)
        self.owner = placement   # told when a segment takes no more chunks (``mark_filled``)
        self.close: SimChunk | None = None   # its close chunk, once full

    def new_segment(self, id: int, size: int) -> SimSegment:
        return SimSegment(id, self.segment_size, size)


class SimStreamlet:
    __slots__ = ("index", "active", "groups", "sequences")

    def __init__(self, index: int, q: int):
        self.index = index
        self.active: list[SimGroup | None] = [None] * q
        self.groups: list[SimGroup] = []
        self.sequences: dict[int, int] = {}   # producer -> its last sequence here


class SimPlacement:
    """One stream's streamlets on the simulated broker, over its vlogs."""

    def __init__(self, rng, vlogs: list[VirtualLog], replication: int):
        self.vlogs = vlogs
        self.q = rng.choice((1, 2))
        self.max_segments = rng.choice((2, 3, 4))
        self.segment_size = rng.choice((400, 1000, 3000))
        self.streamlets = [SimStreamlet(i, self.q) for i in range(rng.choice((1, 2, 3)))]
        self.producers = rng.choice((1, 3, 5))
        self.mapping = VlogMapping("shared", len(vlogs))
        self.stream = StreamMeta(name="sim", id=STREAM, streamlets=len(self.streamlets), groups=self.q,
                                 replication=replication, segment_size=self.segment_size,
                                 group_segments=self.max_segments,
                                 owners=((1, 1),) * len(self.streamlets))
        self.replicators = {v.id: SimpleNamespace(log=v) for v in vlogs}
        # no limit, or room for a few vsegs' worth of chunks per vlog and two segments per active
        # group: much of it is spent on filled segments waiting in idle vlogs' open vsegs, which
        # the budget's pass closes (``World._reclaim``) so they settle and are evicted
        room = rng.choice((0, 2, 4)) * vlogs[0].capacity * len(vlogs)
        self.memory = MemoryBudget(room and room + 2 * self.segment_size * len(self.streamlets) * self.q)
        self.chunks: list[SimChunk] = []
        self.by_vlog: dict[int, list[SimChunk]] = {v.id: [] for v in vlogs}
        self.refused = 0   # chunks refused (BrokerFull)

    def append(self, sl: SimStreamlet, producer: int, size: int) -> VirtualLog | None:
        """Append one chunk of ``producer`` to ``sl``; the vlog it went to (None: refused)."""
        slot = producer % self.q
        g = sl.active[slot]
        c = SimChunk(0, None, sl.index, 0, 0, 0, size, producer, 0)
        while True:
            if g is None or g.closed:
                g = sl.active[slot] = SimGroup(len(sl.groups), slot, self)
                sl.groups.append(g)
            try:
                placed = g.append(c)
            except BrokerFull:
                self.refused += 1
                return None
            if placed is not None:
                break
            seg = g.segments[-1]   # full and closed: its close chunk goes first
            g.close = self._reference(g, None, SimChunk(g.vlog.id, None, sl.index, g.id, seg.id, seg.head,
                                                     CLOSE_SIZE, producer, 0, chunk.CLOSE))
        if g.vlog is None:
            g.vlog = self.vlogs[self.mapping.key(self.stream, sl.index, g.id)[2]]
        seg = c.seg
        c.vlog, c.group = g.vlog.id, g.id
        c.sequence = sl.sequences[producer] = sl.sequences.get(producer, 0) + 1
        self._reference(g, seg, c)
        return g.vlog

    def _reference(self, g: SimGroup, seg: SimSegment | None, c: SimChunk) -> SimChunk:
        v = g.vlog
        c.cid = len(self.chunks)
        v.append(seg if seg is not None else c, c.offset if seg is not None else 0, c.size, 0)
        vs = v.vsegs[-1]
        c.vseg, c.voff = vs.id, vs.ends[-1] - c.size
        if seg is not None:
            seg.noted(self.replicators[v.id], vs, c.voff)
        self.chunks.append(c)
        self.by_vlog[v.id].append(c)
        return c

    def charged(self) -> int:
        """What the budget should be charged: every segment's buffer still in memory."""
        return sum(seg.held for sl in self.streamlets for g in sl.groups for seg in g.segments)

    def takes_segment(self) -> bool:
        """Whether the budget would take a new segment now (evicting what it may)."""
        try:
            self.memory.reserve(self.segment_size)
        except BrokerFull:
            return False
        self.memory.release(self.segment_size)
        return True

    def mark_filled(self, g: SimGroup, seg: SimSegment) -> None:
        """The segment takes no more chunks (``Group.owner``, as ``Streamlet.mark_filled``)."""
        if not seg.filled_at:
            seg.filled_at = 1.0
            self.memory.filled(seg)
