"""Streamlet: a partition of a stream, with up to Q active groups.

Producer p appends to active group ``p % Q``; when that group fills up it
closes (the broker records the close in the group's vlog: ``group_close``)
and a new group (next id) takes its slot. Per producer, the last
sequence seen makes retries idempotent: a sequence already appended is
acknowledged again (once durable), never stored twice; a sequence that skips
ahead is refused so the producer resends in order, unless its chunk carries
``SEQ_RESET``: the producer gave up on the chunks in between, and that
sequence is its new base.
"""

from __future__ import annotations

import time
from collections import deque
from types import MappingProxyType

from .. import chunk as chunk_
from ..errors import DataLoss, OutOfRange, RecordTooLarge
from ..kafka.log import OffsetLog
from ..limits import MAX_CHUNK
from ..position import DONE, unpack
from ..stream_meta import StreamMeta
from .group import Group
from .ledger import Ledger
from .pending import Pending
from .segment import Segment
from .sequences import ProducerState, verdict

DELETE_RETENTION_MS = 86_400_000  # Kafka's delete.retention.ms default: tombstones kept a day
SEGMENT_MS = 60_000  # segment.ms of compacted streams: their newest segment is compacted a minute on
SEAL_GAP = 1 << 16  # group ids skipped after a loss: more groups than one lost range can hold
NONE: MappingProxyType = MappingProxyType({})  # what a streamlet has none of yet (its maps made on first use)


class Streamlet:
    """A broker holds one per streamlet it owns, most of them idle or holding a few records:
    slots, and the maps and queues it has none of yet are the shared ``NONE`` (or an empty
    tuple) until first used."""

    __slots__ = ("stream_id", "index", "q", "segment_size", "max_segments", "groups", "active",
                 "next_group", "producers", "appended_chunks", "appended_bytes", "tails",
                 "plain_last", "key_last", "recovering", "pending", "memory",
                 "ledger", "filled", "freed_bytes", "freed_segments", "waiting", "on_close",
                 "retention_bytes", "retention_ms", "compact", "delete_retention_ms", "segment_ms",
                 "tombstone_due", "offsets")

    def __init__(self, stream: StreamMeta, index: int, memory=None, ledger: Ledger | None = None):
        self.stream_id = stream.id
        self.index = index
        self.q = stream.groups
        self.segment_size = stream.segment_size
        self.max_segments = stream.group_segments
        self.groups: dict[int, Group] = NONE   # made with its first group (``_new_group``)
        self.active: list[Group | None] = [None] * self.q
        self.next_group = 0
        # its producers' states (``producer``, ``_add_producer``): NONE, the one producer's
        # state (most streamlets are written by one producer; a dict of one entry is 224
        # bytes), or a dict by producer id from the second on
        self.producers: ProducerState | dict[int, ProducerState] = NONE
        self.appended_chunks = 0
        self.appended_bytes = 0
        # per vlog its chunks went to, the ref of its last chunk there (a tail's barrier): one flat
        # list [vlog, ref, ...], as a streamlet's chunks go to one vlog at a time (a dict of one
        # entry is three times the size)
        self.tails: list | tuple = ()
        # for append_if: appended_chunks after the last chunk appended by produce, and after
        # the last append_if of each key (a conditional write conflicts only with its key)
        self.plain_last = 0
        self.key_last: dict[bytes, int] = NONE
        self.recovering = False  # being rebuilt from backups: no produce, no pull yet
        # the groups of dead incarnations still to be adopted here after the hand-over (closed
        # history, kera.recovery.adoption): reads that reach them wait, retention waits
        self.pending: Pending | MappingProxyType = NONE
        self.memory = memory     # the broker's budget (see MemoryBudget)
        self.ledger = ledger     # the broker's, over all its streamlets
        self.filled: deque = ()  # (group, segment) that take no more chunks, oldest first
        self.freed_bytes = 0     # chunk bytes freed by retention
        self.freed_segments = 0
        self.waiting = None      # an expired segment whose vsegs are still open (idle vlog)
        self.on_close = None     # called with (streamlet, group, producer) when a full group closes
        self.offsets: OffsetLog | None = None   # its dense Kafka offsets, from its first chunk
        self.configure(stream)

    def configure(self, stream: StreamMeta) -> None:
        """Retention (Kafka's meaning, -1 unbounded): ``retention_bytes`` is the stream's total,
        shared by its streamlets; ``retention_ms`` the age of a segment's last chunk."""
        rb = stream.retention_bytes
        self.retention_bytes = -1 if rb < 0 else -(-rb // max(1, stream.streamlets))
        self.retention_ms = stream.retention_ms
        # key compaction (Kafka's cleanup.policy, delete.retention.ms, segment.ms): see compactor
        self.compact = stream.compacted
        if "delete" not in stream.cleanup_policy:  # compact alone: a key's latest record is never expired
            self.retention_bytes = self.retention_ms = -1
        self.delete_retention_ms = (DELETE_RETENTION_MS if stream.delete_retention_ms is None
                                    else stream.delete_retention_ms)
        self.segment_ms = SEGMENT_MS if stream.segment_ms is None else stream.segment_ms
        self.tombstone_due = None  # wall time (s) the oldest tombstone kept by compaction expires
        if self.ledger is not None:
            if self.compact:
                self.ledger.compacted[self] = None
            else:
                self.ledger.compacted.pop(self, None)
            self._expiring()

    def _expiring(self) -> None:
        """Under retention and holding filled segments: the reclaim pass looks at it."""
        if self.filled and (self.retention_bytes >= 0 or self.retention_ms >= 0):
            self.ledger.expiring[self] = None

    @property
    def retained_bytes(self) -> int:
        return self.appended_bytes - self.freed_bytes

    def mark_filled(self, g: Group, seg) -> None:
        if seg.filled_at:  # rolled by segment.ms already
            return
        seg.filled_at = time.time()
        if not self.filled:
            self.filled = deque()
        self.filled.append((g, seg))
        if self.ledger is not None:
            self._expiring()
        # a compacted stream's segments are not evicted: compaction rewrites them in memory
        if self.memory is not None and not self.compact:
            self.memory.filled(seg)

    def _count(self, chunks: int, nbytes: int) -> None:
        """Chunks appended here (and counted by the broker): appended, placed or adopted."""
        self.appended_chunks += chunks
        self.appended_bytes += nbytes
        if self.ledger is not None:
            self.ledger.chunks += chunks
            self.ledger.bytes += nbytes

    def leave(self) -> list:
        """The stream leaves this broker: every segment still held (the caller frees them),
        and it leaves the broker's ledger."""
        segs = [seg for g in self.groups.values() for seg in g.segments[g.start:]]
        if self.ledger is not None:
            self.ledger.chunks -= self.appended_chunks
            self.ledger.bytes -= self.appended_bytes
            self.ledger.expiring.pop(self, None)
            self.ledger.compacted.pop(self, None)
            self.ledger = None
        self.groups = NONE
        self.producers = NONE
        return segs

    def starts(self) -> dict:
        """Where a reader may restart: each group's first position, and the next group id."""
        return {"next": self.next_group, "groups": {gid: g.first() for gid, g in self.groups.items()}}

    def start_position(self) -> tuple[int, int, int]:
        """(lowest group held, its first segment, chunk bytes held): for status."""
        if not self.groups:
            return self.next_group, 0, 0
        gid = min(self.groups)
        return gid, self.groups[gid].start, self.retained_bytes

    def _new_group(self, slot: int, gid: int | None = None) -> Group:
        if gid is None:
            gid = self.next_group
        g = Group(gid, slot, self.segment_size, self.max_segments, self.memory)
        g.owner = self
        if not self.groups:
            self.groups = {}
        self.groups[gid] = g
        self.next_group = max(self.next_group, gid + 1)
        return g

    def check_sequence(self, producer: int, seq: int, reset: int = 0) -> ProducerState | None:
        """The state of a duplicate (already appended), None for a chunk to append
        (``sequences.verdict``)."""
        return verdict(self.producer(producer), producer, seq, reset, self.stream_id, self.index)

    @property
    def max_chunk(self) -> int:
        """The largest chunk this streamlet takes: it must fit a segment, and be replicable."""
        return min(MAX_CHUNK, self.segment_size)

    def append(self, chunk, producer: int):
        """Append one chunk to its active group: returns (group, segment, offset)."""
        if len(chunk) > self.segment_size or len(chunk) > MAX_CHUNK:
            limit = "MAX_CHUNK" if self.segment_size >= MAX_CHUNK else "segment_size"
            raise RecordTooLarge(
                f"chunk of {len(chunk)} bytes exceeds {self.max_chunk} bytes (the smaller of MAX_CHUNK "
                f"and the segment size of stream {self.stream_id})",
                limit=limit, bound=self.max_chunk, size=len(chunk))
        slot = producer % self.q
        g = self.active[slot]
        while True:
            if g is None or g.closed:
                g = self.active[slot] = self._new_group(slot)
            placed = g.append(chunk)
            if placed is not None:
                break
            if self.on_close is not None:  # its close chunk goes before this one (group_close)
                self.on_close(self, g, producer)
        seg, off = placed
        self._count(1, len(chunk))
        # its Kafka offsets (the caller writes the base with the placement: ``kafka_base``)
        self.kafka_log().append(seg.records[-1] - (seg.records[-2] if len(seg.records) > 1 else 0),
                                g.id, seg.id, off, len(chunk))
        return g, seg, off

    @property
    def kafka_base(self) -> int:
        """The Kafka base offset of the chunk just appended."""
        return self.offsets.last_base

    def kafka_log(self) -> OffsetLog:
        if self.offsets is None:
            self.offsets = OffsetLog()
        return self.offsets

    def place(self, chunk, producer: int, group: int, segment: int, offset: int):
        """Recovery append at the placement recorded in the chunk header.

        Returns (group, segment), segment None for a copy already placed.
        Raises ``DataLoss`` (stream and streamlet named) for a placement past
        a hole: the caller refuses the chunk, so the loss is known.
        """
        g = self.groups.get(group)
        created = g is None
        next_group = self.next_group
        if created:
            g = self._new_group(producer % self.q, group)
        try:
            # retention or compaction may have freed the group's first segments on the dead broker
            seg = g.place(segment, offset, chunk,
                          self.retention_bytes >= 0 or self.retention_ms >= 0 or self.compact)
        except DataLoss as e:
            if created and not g.segments:  # made for this chunk: leave no trace of it
                del self.groups[group]
                self.next_group = next_group
            e.args = (f"stream {self.stream_id} streamlet {self.index}: {e}",)
            e.stream_id, e.streamlet = self.stream_id, self.index
            raise
        if seg is not None:
            self._count(1, len(chunk))
            if len(chunk) >= chunk_.HEADER_SIZE:
                self.kafka_log().replayed(chunk_.kafka_offset(chunk), chunk_.HEADER.unpack_from(chunk)[5],
                                         group, segment, offset, len(chunk))
        return g, seg

    def adopt(self, group: int, producer: int, seg) -> bool:
        """Recovery: a segment re-pointed at the dead broker's backups (evicted, index only),
        next in its group; False if the group holds it already (an adopt sent again)."""
        g = self.groups.get(group)
        if g is None:
            g = self._new_group(producer % self.q, group)
        n = len(g.segments)
        if seg.id < n:
            return False
        if n == 0 and seg.id > 0:  # the ones before were freed on the dead broker
            g.segments = [Segment.gone(i) for i in range(seg.id)]
            g.start = n = seg.id
        if seg.id != n:
            raise DataLoss(f"stream {self.stream_id} streamlet {self.index}: adopted segment "
                           f"{seg.id} of group {group} after {n} segments")
        g.segments.append(seg)
        self.mark_filled(g, seg)
        self._count(len(seg.ends), seg.head)
        self.kafka_log().adopted(group, seg)   # its Kafka offsets, as the dead broker gave them
        return True

    def pend(self, source: tuple[int, int], ranges, highest: dict, tops: dict, kafka_next=0) -> None:
        """``source``'s closed groups (``ranges`` of ids, [lo, hi] each; ``tops``: per slot,
        the newest of them) are adopted here after we serve (``Pending``). Until ``unpend``:
        a read reaching one of them is refused (``Recovering``, retried), retention frees
        nothing, no new group takes their ids, and the groups held that are pending (partly
        adopted) or older than a pending group of their slot take no more chunks; the
        producers' highest sequences in them are noted now, so a resend of one of their
        chunks stays a duplicate; ``kafka_next``: the end of their Kafka offsets, where
        appends go on."""
        if not self.pending:
            self.pending = Pending()
        self.kafka_log().reach(kafka_next)
        self.pending.add(source, ranges, tops)
        self.next_group = max(self.next_group, self.pending.top() + 1)
        self.note_adopted(highest)
        if not self.recovering:
            self._close_pending()

    def is_pending(self, gid: int) -> bool:
        return self.pending.covers(gid) if self.pending else False

    def _close_pending(self) -> None:
        """A group held that is pending (partly adopted: adopted to its end, never appended
        to), or older than a pending group of its slot (that slot moved on), takes no more
        chunks, as ``finish_recovery`` closes a slot's older groups."""
        tops = self.pending.slot_tops()
        for gid, g in self.groups.items():
            if not g.closed and (gid < tops.get(g.slot, -1) or self.pending.covers(gid)):
                g.closed = True
                for slot, a in enumerate(self.active):
                    if a is g:
                        self.active[slot] = None

    def unpend(self, source: tuple[int, int]) -> None:
        """``source``'s groups are adopted (durable, claimed): served like any other."""
        if self.pending and self.pending.drop(source):
            self.kafka_log().finish()   # the adopted chunks' offsets in order
            self._closed_last()
            self.filled = deque(sorted(self.filled, key=lambda gs: (gs[0].id, gs[1].id)))

    def forget_pending(self) -> None:
        """A recovery attempt again: it tells what is pending anew."""
        self.pending = NONE

    def producer(self, producer: int) -> ProducerState | None:
        """The state of ``producer`` here, None if it wrote nothing here."""
        p = self.producers
        if p.__class__ is ProducerState:
            return p if p.producer == producer else None
        return p.get(producer)

    def _add_producer(self, st: ProducerState) -> None:
        p = self.producers
        if not p:
            self.producers = st
        elif p.__class__ is ProducerState:
            self.producers = {p.producer: p, st.producer: st}
        else:
            p[st.producer] = st

    def note_adopted(self, highest: dict[int, int]) -> None:
        """Producers' highest sequences in adopted segments: a late resend of an adopted chunk
        stays a duplicate."""
        for p, q in highest.items():
            st = self.producer(p)
            if st is None:
                self._add_producer(ProducerState(p, q, []))
            elif q > st.last_seq:
                st.last_seq = q

    def note_producer(self, producer: int, sequence: int, vlog, ref: int, segment=None,
                      end: int = 0) -> None:
        """Remember a producer's chunk just appended to ``vlog`` as ``ref``: its sequence
        (replayed vlogs may come in any order: keep the highest), per vlog its highest ref
        (with the chunk's segment and end), and the streamlet's tail in that vlog."""
        tails = self.tails
        if not tails:
            self.tails = [vlog, ref]
        elif tails[0] == vlog:
            tails[1] = ref
        else:
            for i in range(2, len(tails), 2):
                if tails[i] == vlog:
                    tails[i + 1] = ref
                    break
            else:
                tails += (vlog, ref)
        st = self.producer(producer)
        if st is None:
            self._add_producer(ProducerState(producer, sequence, [vlog, ref, segment, end]))
            return
        if sequence > st.last_seq:
            st.last_seq = sequence
        st.note(vlog, ref, segment, end)

    def note_key(self, key: bytes) -> None:
        """An append_if of ``key`` was just appended."""
        if not self.key_last:
            self.key_last = {}
        self.key_last[key] = self.appended_chunks

    def finish_recovery(self) -> None:
        """Rebuilt: the newest group of each slot is active again, older ones are closed."""
        if self.pending:
            self._close_pending()
        newest: dict[int, Group] = {}
        for gid in sorted(self.groups):
            g = self.groups[gid]
            if g.slot in newest:
                newest[g.slot].closed = True
            newest[g.slot] = g
        self.active = [None] * self.q
        for slot, g in newest.items():
            if slot < self.q and not g.closed:
                self.active[slot] = g
        self._closed_last()
        if self.offsets is not None:
            self.offsets.finish()
        # replayed vlog by vlog: oldest first is group order, not the order they were placed
        if self.filled:
            self.filled = deque(sorted(self.filled, key=lambda gs: (gs[0].id, gs[1].id)))
        self.recovering = False

    def _closed_last(self) -> None:
        """A closed group's last segment takes no more chunks: retention and eviction may take it."""
        if not self.groups:
            return
        held = {id(seg) for _, seg in self.filled}
        for g in self.groups.values():
            if g.closed and len(g.segments) > g.start and id(g.segments[-1]) not in held:
                self.mark_filled(g, g.segments[-1])

    def seal(self) -> None:
        """Recovered with a range lost on every copy: close every group and number new ones
        far past the highest seen, so no position of the lost range (which may have held
        groups never replayed) is ever given to other records."""
        for g in self.groups.values():
            g.closed = True
        self.active = [None] * self.q
        self.next_group += SEAL_GAP
        self._closed_last()

    def read(self, low: int, positions: dict, max_bytes: int):
        """Entries (group, segment, offset, length, next_pos) of durable data to pull.

        Groups are read in id order; a group not read to its end holds back
        the later groups of its slot, so one producer's records come out in
        the order they were sent.
        """
        if self.pending:
            self.pending.check(low, positions, f"stream {self.stream_id} streamlet {self.index}")
        out = []
        for gid, pos in positions.items():
            if pos == DONE or gid < low:
                continue
            g = self.groups.get(gid)
            if (g is None and gid < self.next_group) or (g is not None and unpack(pos)[0] < g.start):
                if not self.compact:
                    raise OutOfRange(f"stream {self.stream_id} streamlet {self.index} group {gid}: "
                                     f"position {pos} was freed by retention")
                # a compacted stream: what was freed held nothing a reader still needs (Kafka's
                # positions in a compacted log stay valid): read on from what is left
                if g is None:
                    out.append((gid, 0, 0, 0, DONE))
        budget = max_bytes
        blocked = set()
        for gid in sorted(self.groups):
            if gid < low or budget <= 0:
                continue
            g = self.groups[gid]
            pos = positions.get(gid)
            if pos is None or (pos != DONE and unpack(pos)[0] < g.start):
                pos = g.first()
            if pos == DONE:
                continue
            if g.slot in blocked:
                continue
            while budget > 0:
                si, off, n, nxt = g.read(pos, budget)
                if n == 0 and nxt == pos:
                    break
                out.append((gid, si, off, n, nxt))
                budget -= n
                pos = nxt
                if nxt == DONE:
                    break
            if pos != DONE:
                blocked.add(g.slot)
        return out

    def latest(self) -> tuple[int, dict]:
        """Positions at the durable end of every group: a consumer starting 'latest'. Groups
        pending (``pend``) count as read, even those partly adopted."""
        positions = {}
        for gid, g in self.groups.items():
            positions[gid] = DONE if g.finished() else g.durable_end()
        if self.pending:
            positions.update(self.pending.done())
        return 0, positions
