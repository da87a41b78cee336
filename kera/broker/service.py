"""BrokerService: the broker process.

Producer requests carry chunks for many streamlets; each chunk is verified,
appended with one copy into its streamlet's active group, stamped with its
placement, and referenced in its virtual log. The request then waits (for
``acks=all``) until every vlog it touched is durable past its chunks.

The service is the broker's RPC face and its life: what it holds (streams, streamlets,
the ledger, the memory budget), streamlet assignment, the produce and compare-and-append
paths, and its virtual logs. The rest is done by parts that each own their state and
are handed what they need of the others:

- ``membership`` (``kera.broker.membership``): the incarnation (id, epoch, lease, fenced),
  registration and heartbeats;
- ``reads`` (``kera.broker.pull.Pulls``): pulls, offsets, seeks and lag;
- ``takeover`` (``kera.broker.takeover``): the recovery RPCs, and the adoptions not yet
  settled;
- ``reclaim`` (``kera.broker.reclaim``): retention, release, eviction, and what was freed.

The command line is ``kera.broker.main``.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import trio

from .. import chunk, group_positions, limits, metafile, wire
from ..coordinator.link import CoordinatorLink
from ..door import Door
from ..errors import (
    Conflict,
    Fenced,
    InvalidArgument,
    KeraError,
    NotOwner,
    Recovering,
    Unauthorized,
)
from ..rpc import Later, Pool, advertised
from ..security.credentials import Credentials
from ..security.gate import Gate, take_state
from ..security.mechanisms import BROKER, CLIENT
from ..server import Service
from ..stream_meta import StreamMeta
from ..vlog import VlogMapping, when_all_durable
from .adopted import Claims
from .assignment import Assignment
from .compactor import Compactor
from .ledger import Ledger
from .membership import Membership
from .memory import MemoryBudget
from .pull import Pulls
from .pull_sessions import PullSessions
from .reclaim import Reclaim
from .replicator import Replicator
from .streamlet import Streamlet
from .takeover import Takeover
from .tiered import TieredReader
from .vlogs import VirtualLogs

log = logging.getLogger("kera.broker")

# flags only brokers set (index, close and compacted chunks): refused in a client's chunk
BROKER_FLAGS = chunk.INDEX | chunk.CLOSE | chunk.COMPACTED


class BrokerService(Service):
    rpcs = wire.BROKER_RPCS

    def __init__(self, coordinator: str, data_dir: str, node: str, mapping: VlogMapping,
                 vseg_size: int = limits.DEFAULT_VSEG_SIZE, replicate_timeout: float = 5.0,
                 memory: int = 0, *, cluster_secret: bytes, auth: bool = False,
                 door: Door | None = None, tls=(None, None)):
        self.coordinator = coordinator
        self.tls = tls[0]   # the listener's TLS context (None: plaintext)
        self.gate = Gate(cluster_secret, auth=auth)
        self.door = door or Door()
        self.data_dir = data_dir
        self.node = node
        self.memory = MemoryBudget(memory)
        os.makedirs(data_dir, exist_ok=True)
        id_path = os.path.join(data_dir, "broker.id")
        # what this broker's connections present to the others: a broker, as itself
        self.credentials = Credentials.member(cluster_secret, BROKER, (metafile.load(id_path) or {}).get("id"),
                                              tls=tls[1])
        self.addr = ""
        self.advertise = ""        # HOST[:PORT] others reach us at (default: the bound host and port)
        self.streams: dict[int, StreamMeta] = {}
        self.streamlets: dict[tuple[int, int], Streamlet] = {}
        self.ledger = Ledger()     # what is kept over all of them (kera.broker.streamlet)
        self.sessions = PullSessions()   # readers' pull sessions (kera.broker.pull_sessions)
        self.pool: Pool | None = None
        self.nursery: trio.Nursery | None = None
        self.requests = 0
        self.tiered: TieredReader | None = None
        self.claims: Claims | None = None   # foreign vsegs of adopted segments (kera.broker.adopted)
        # what producers sent and consumers read (per request and per pull entry, never per record)
        self.records_in = self.bytes_in = self.records_out = self.bytes_out = self.pulls = 0
        self.metrics = None        # kera.metrics.broker, with --metrics-port
        self.kafka = None          # kera.kafka's gateway, with --kafka-listener
        self.names: dict[str, int] = {}   # stream name -> id, of the streams held here
        # the parts
        self.membership = Membership(id_path, self.credentials, self.gate, hello=self._hello,
                                     stats=self.stats, on_backups=self._set_backups)
        self.logs = VirtualLogs(node, mapping, vseg_size, replicate_timeout, self.streams,
                                lambda: (self.broker_id, self.epoch))
        self.vlog_for, self.notify_durable = self.logs.vlog_for, self.logs.notify_durable
        self.reclaim = Reclaim(self.streams, self.streamlets, self.ledger, self.memory, self.logs.vlogs,
                               tiered=lambda: self.tiered, claims=lambda: self.claims)
        self.compactor = Compactor(self.streamlets, self.ledger.compacted, self.memory,
                                   self.reclaim.free)  # key compaction
        self.takeover = Takeover(self.streams, self.streamlets, self.membership, vlog_for=self.vlog_for,
                                 append_close=self.logs.append_close, durable=self._durable,
                                 free=self.reclaim.free, claims=lambda: self.claims)
        self.reads = Pulls(self)
        self.assignment = Assignment(self.streams, self.names, self.streamlets, self.memory, self.ledger,
                                     self.membership, self.logs, self.reclaim)

    # -- the incarnation (kera.broker.membership) -----------------------------------
    @property
    def broker_id(self) -> int | None:
        return self.membership.broker_id

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    @property
    def fenced(self) -> bool:
        return self.membership.fenced

    def _hello(self) -> dict:
        """What a register tells the coordinator of us."""
        return {"addr": self.addr, "node": self.node,
                **({"kafka": self.kafka.addr} if self.kafka is not None else {})}

    def _check_epoch(self, meta) -> None:
        self.membership.check_epoch(meta)

    def _check_lease(self) -> None:
        self.membership.check_lease()

    # -- virtual logs (kera.broker.vlogs) ----------------------------------------------
    @property
    def durable_event(self) -> trio.Event:
        return self.logs.durable_event

    def _set_backups(self, live: list[dict]) -> None:
        self.logs.set_backups(live)

    # -- control -----------------------------------------------------------------
    def rpc_assign(self, meta, payload):
        return self.assignment.assign(meta)

    def rpc_configure(self, meta, payload):
        return self.assignment.configure(meta)

    def rpc_unassign(self, meta, payload):
        return self.assignment.unassign(meta)

    def rpc_security(self, meta, payload):
        """The users and ACLs, pushed by the coordinator when they change."""
        return take_state(self.gate, meta)

    def rpc_ping(self, meta, payload):
        return {"broker": self.broker_id, "epoch": self.epoch}

    def rpc_kafka_map(self, meta, payload):
        """Kafka offsets of streamlets held here as positions, or back (kera.kafka.offsets)."""
        from ..kafka.offsets import kafka_map
        return kafka_map(self, meta)

    # -- produce -------------------------------------------------------------------
    def _streamlet(self, stream_id, index) -> Streamlet:
        sl = self.streamlets.get((stream_id, index))
        if sl is None:
            raise NotOwner(f"stream {stream_id} streamlet {index} is not on broker {self.broker_id}")
        if sl.recovering:
            raise Recovering(f"stream {stream_id} streamlet {index} is being recovered")
        return sl

    @staticmethod
    def _writer(meta, peer) -> tuple[set | None, bool]:
        """What a produce's chunks are checked against: the producer ids bound to a client's
        connection (None: a member's, unchecked), and whether ACLs apply. A client's ids are
        bound with the token issued with them (``Peer.bind_producer``)."""
        if peer.role != CLIENT:
            return None, False
        if meta.get("producer") is not None:
            peer.bind_producer(meta["producer"], meta.get("token"))
        return peer.producers, peer.gate.auth

    def _allowed(self, decided: dict, peer, sid: int, payload, off: int) -> bool:
        """Whether a client may write this chunk, by the ACLs: its stream's, judged once per
        stream id and connection while the ACLs stay the same (``decided``, the connection's
        ``Peer.decisions``: a stream id names one stream forever), or for a commit of
        consumer-group positions, its records' groups', judged per chunk."""
        ok = decided.get(sid)
        if ok is None:
            s = self.streams.get(sid)
            if s is None:
                return True   # not held here: its own error follows (nothing kept)
            if s.name == group_positions.NAME:
                return self._may_commit(peer, payload, off)
            ok = peer.decide(sid, peer.may("write", "stream", s.name))
        return ok

    @staticmethod
    def _may_commit(peer, payload, off: int) -> bool:
        """A chunk of consumer-group positions: its every record names a group the principal
        may read (Kafka's offset commit), its key being [group, stream]."""
        h = chunk.parse_header(payload, off)
        for key in chunk.ChunkView(payload, off, h).keys():
            group = group_positions.group_of(key)
            if group is None or not peer.may("read", "group", group):
                return False
        return True

    def _may(self, peer, op: str, stream_id) -> bool:
        """Whether ``peer`` may ``op`` the stream of this id (one this broker does not hold is
        left to the caller's own error)."""
        s = self.streams.get(stream_id)
        return s is None or peer.may(op, "stream", s.name)

    def rpc_produce(self, meta, payload, peer):
        if self.fenced:
            raise Fenced("this broker was fenced")
        self._check_lease()
        acks = meta.get("acks", "all")
        # every checksum verified before anything is stored; header fields as arrays
        heads, offs = chunk.scan_headers(payload)
        bound, acl = self._writer(meta, peer)
        decided = peer.decisions() if acl else None   # stream id -> may write
        self.requests += 1
        errors = []
        placed, want = _placed_wanted(meta, len(offs))  # [chunk, group, segment, offset], when asked
        waits: dict[Replicator, int] = {}
        touched: dict[Replicator, list] | None = {} if self.sessions else None
        streams, streamlets = self.streams, self.streamlets
        reset = chunk.SEQ_RESET
        for i, (sid, index, producer, seq, flags, off, size, checksum) in enumerate(zip(
                heads["stream_id"].tolist(), heads["streamlet"].tolist(), heads["producer_id"].tolist(),
                heads["sequence"].tolist(), heads["flags"].tolist(), offs,
                (heads["body_len"] + chunk.HEADER_SIZE).tolist(), heads["body_checksum"].tolist(),
                strict=True)):
            try:
                if flags & BROKER_FLAGS:
                    raise _broker_flags(flags)
                if bound is not None and (producer not in bound or acl and not self._allowed(
                        decided, peer, sid, payload, off)):
                    errors.append([i, Unauthorized.code])
                    continue
                sl = streamlets.get((sid, index))
                if sl is None or sl.recovering:
                    sl = self._streamlet(sid, index)  # raises the right error
                st = sl.check_sequence(producer, seq, flags & reset)
                if st is not None:  # a resend of a chunk already appended: acked once it is durable
                    for v, ref in st.waits():
                        if waits.get(v, 0) < ref:
                            waits[v] = ref
                    continue
                g, seg, soff = sl.append(payload[off:off + size], producer)
                chunk.place(seg.buf, soff, g.id, seg.id, soff, sl.kafka_base)
                if placed is not None and (want is None or want[i]):
                    placed.append((i, g.id, seg.id, soff))
                vlog = g.vlog or self.vlog_for(streams[sid], index, g)
                idx = waits[vlog] = vlog.append(seg, soff, size, checksum)
                sl.note_producer(producer, seq, vlog, idx, seg, soff + size)
                sl.plain_last = sl.appended_chunks
                if touched is not None:
                    touched.setdefault(vlog, []).append((sid, index))
            except KeraError as e:
                errors.append([i, e.code])
        if touched:
            self._touch_when_durable(touched, waits)
        result = {"errors": errors} if placed is None else {"errors": errors, "placed": placed}
        counts = heads["record_count"]
        self.records_in += int(counts.sum()) - sum(int(counts[e[0]]) for e in errors)
        self.bytes_in += len(payload)
        if acks != "all" or not waits:
            return result
        return self._acked_when_durable(waits, result)

    # -- compare-and-append: a streamlet as one linearizable register sequence -----------------
    async def rpc_tail(self, meta, payload, peer):
        """A linearizable read's barrier: once everything appended to the streamlet so far is
        durable, its durable end positions and a ``token`` naming that state for ``append_if``.
        Served only under a live lease, so no successor can have taken writes before it."""
        if not self._may(peer, "read", meta["stream_id"]):
            raise Unauthorized(f"{peer.principal} may not read stream {meta['stream_id']}")
        sl = self._streamlet(meta["stream_id"], meta["streamlet"])
        self._check_lease()
        token = [self.epoch, sl.appended_chunks]
        tails = list(sl.tails)
        for i in range(0, len(tails), 2):
            await tails[i].wait_durable(tails[i + 1])
        low, groups = sl.latest()
        return {"token": token, "low": low, "groups": groups}

    def rpc_append_if(self, meta, payload, peer):
        """One chunk of one keyed record, appended only if no record with that key (and no
        produced chunk) was appended since the state ``expect`` (a ``tail`` token) names,
        else ``conflict``: the compare-and-set a key-value map's writes need. A write
        decided on a key's state at the token applies to the same state, so writes to
        other keys need not conflict. Answered once durable.

        A resend of a chunk already appended (same producer and sequence, here or before a
        recovery) is acknowledged, not compared: a writer whose answer was lost learns that
        its write landed."""
        if self.fenced:
            raise Fenced("this broker was fenced")
        self._check_lease()
        chunks = chunk.scan(payload)
        if len(chunks) != 1:
            raise InvalidArgument("append_if takes exactly one chunk")
        h, off = chunks[0]
        if h.flags & BROKER_FLAGS:
            raise _broker_flags(h.flags)
        bound, acl = self._writer(meta, peer)
        if bound is not None and (h.producer_id not in bound or
                                  acl and not self._allowed(peer.decisions(), peer, h.stream_id, payload, off)):
            raise Unauthorized(f"{peer.principal} may not write stream {h.stream_id} as producer "
                               f"{h.producer_id}")
        if h.record_count != 1:
            raise InvalidArgument("append_if takes a chunk of exactly one record")
        sl = self._streamlet(h.stream_id, h.streamlet)
        st = sl.check_sequence(h.producer_id, h.sequence, h.flags & chunk.SEQ_RESET)
        if st is not None:
            return self._acked_when_durable(dict(st.waits()), {"duplicate": True})
        key = chunk.ChunkView(payload, off, h).keys()[0] or b""
        expect = meta.get("expect")
        if not (isinstance(expect, list) and len(expect) == 2 and expect[0] == self.epoch
                and isinstance(expect[1], int) and expect[1] >= max(sl.plain_last, sl.key_last.get(key, 0))):
            raise Conflict(f"stream {h.stream_id} streamlet {h.streamlet} changed since {expect}")
        g, seg, soff = sl.append(payload[off:off + h.size], h.producer_id)
        chunk.place(seg.buf, soff, g.id, seg.id, soff, sl.kafka_base)
        vlog = g.vlog or self.vlog_for(self.streams[h.stream_id], h.streamlet, g)
        idx = vlog.append(seg, soff, h.size, h.body_checksum)
        sl.note_producer(h.producer_id, h.sequence, vlog, idx, seg, soff + h.size)
        sl.note_key(bytes(key))
        if self.sessions:
            self._touch_when_durable({vlog: [(h.stream_id, h.streamlet)]}, {vlog: idx})
        return self._acked_when_durable({vlog: idx}, {"duplicate": False})

    def _touch_when_durable(self, touched: dict, waits: dict) -> None:
        """Once their chunks are durable, streamlets (per vlog) are ready in the pull sessions
        reading them."""
        for vlog, keys in touched.items():
            vlog.when_durable(waits[vlog], lambda error, keys=keys: error or self.sessions.touch(keys))

    @staticmethod
    def _acked_when_durable(waits: dict, reply: dict) -> Later:
        """``reply``, given once every vlog of ``waits`` is durable up to its index."""
        later = Later()
        when_all_durable(waits, lambda: later.done(reply), later.done)
        return later

    @staticmethod
    async def _durable(waits: dict) -> None:
        """Wait until every vlog of ``waits`` is durable up to its index."""
        for vlog, idx in waits.items():
            await vlog.wait_durable(idx)

    # -- the parts' RPCs --------------------------------------------------------------
    async def rpc_pull(self, meta, payload, peer):
        return await self.reads.pull(meta, payload, peer)

    def rpc_offsets(self, meta, payload, peer):
        return self.reads.offsets(meta, payload, peer)

    def rpc_seek(self, meta, payload, peer):
        return self.reads.seek(meta, payload, peer)

    def rpc_lag(self, meta, payload):
        return self.reads.lag(meta, payload)

    async def rpc_recover(self, meta, payload):
        return await self.takeover.recover(meta, payload)

    async def rpc_adopt(self, meta, payload):
        return await self.takeover.adopt(meta, payload)

    def rpc_pend(self, meta, payload):
        return self.takeover.pend(meta, payload)

    async def rpc_settle(self, meta, payload):
        return await self.takeover.settle(meta, payload)

    # -- stats -------------------------------------------------------------------
    def stats(self) -> dict:
        t, logs = self.tiered, self.logs
        return {"memory": self.memory.used, "memory_limit": self.memory.limit,
                "evictions": self.memory.evictions, "evicted_bytes": self.memory.evicted_bytes,
                "freed_segments": self.reclaim.freed_segments, "freed_bytes": self.reclaim.freed_bytes,
                "tiered_reads": t.reads if t else 0, "tiered_bytes": t.bytes if t else 0,
                "tiered_seconds": round(t.seconds, 3) if t else 0.0,
                "tiered_cache": t.cached if t else 0,
                "foreign_vsegs": len(self.claims.vsegs) if self.claims else 0,
                "foreign_released": self.claims.released if self.claims else 0,
                "chunks": self.ledger.chunks, "bytes": self.ledger.bytes,
                "streamlets": len(self.streamlets), "requests": self.requests, "vlogs": logs.stats(),
                "replication": logs.hub.stats() if logs.hub else {},
                "rebuild": logs.rebuilder.stats() if logs.rebuilder else {},
                "compaction": self.compactor.stats(),
                "records_in": self.records_in, "bytes_in": self.bytes_in,
                "records_out": self.records_out, "bytes_out": self.bytes_out, "pulls": self.pulls,
                "recoveries_served": self.assignment.recoveries_served,
                "door": self.door.describe(),
                **({"kafka": self.kafka.stats()} if self.kafka is not None else {}),
                **({"metrics": self.metrics.addr} if self.metrics else {})}

    def rpc_vsegs(self, meta, payload):
        return {"broker": self.broker_id, "vsegs": self.logs.vsegs()}

    def rpc_stats(self, meta, payload):
        out = {"broker": self.broker_id, **self.stats()}
        if meta.get("streams"):
            out["streams"] = self.reclaim.retention_stats()
        return out

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.pool = Pool(nursery, credentials=self.credentials)
            self.coord = self.membership.coord = CoordinatorLink(self.pool, self.coordinator)
            self.claims = Claims(self.pool, lambda: (self.broker_id, self.epoch), self.logs.backup_addr)
            self.tiered = TieredReader(self.pool, lambda: self.broker_id, self.logs.backup_addr,
                                       min(limits.TIERED_CACHE, max(1 << 20, self.memory.limit // 8))
                                       if self.memory.limit else limits.TIERED_CACHE)
            bound = await nursery.start(self.serve, host, port)
            self.addr = advertised(host, bound, self.advertise)
            if self.kafka is not None:   # its address is registered with ours
                await nursery.start(self.kafka.run, self.pool)
            while True:
                await self.membership.register()
                print(f"broker {self.broker_id} listening on {self.addr} (epoch {self.epoch})", flush=True)
                task_status.started(bound)
                task_status = trio.TASK_STATUS_IGNORED
                try:
                    # one incarnation: its vlogs' replication and its heartbeats
                    async with trio.open_nursery() as incarnation:
                        self.nursery = incarnation
                        self.logs.start(incarnation, self.pool)
                        incarnation.start_soon(self.membership.heartbeats)
                        incarnation.start_soon(self.reclaim.reclaimer)
                        incarnation.start_soon(self.reclaim.releaser)
                        incarnation.start_soon(self.compactor.run)
                except* Fenced:
                    log.error("broker %d epoch %d fenced: dropping its state, joining again",
                              self.broker_id, self.epoch)
                self._reset()


    def _reset(self) -> None:
        """Forget everything: a fenced incarnation's streamlets now live elsewhere."""
        self.streams.clear()
        self.names.clear()
        self.streamlets.clear()
        self.ledger.clear()
        self.memory.used = 0
        self.memory.resident.clear()
        if self.tiered is not None:
            self.tiered.cache.clear()
            self.tiered.cached = 0
        self.logs.reset()
        self.takeover.unsettled.clear()
        self.claims = Claims(self.pool, lambda: (self.broker_id, self.epoch), self.logs.backup_addr)
        self.membership.reset()

def _placed_wanted(meta: dict, n: int) -> tuple[list | None, list | None]:
    """Where a produce's chunks were placed is answered for those it names (``positions_of``:
    little-endian uint32 indices of its ``n`` chunks, those carrying delivery callbacks), for
    all of them (``positions``), or for none: a request of thousands of one-record chunks with a
    sampled callback pays for its few, not an entry per chunk each way. Checked before anything
    is stored; ``want`` is one flag per chunk."""
    of = meta.get("positions_of")
    if of is not None:
        if len(of) % 4:
            raise InvalidArgument("positions_of holds 4-byte chunk indices")
        idx = np.frombuffer(of, "<u4")
        if len(idx) > n or (len(idx) and int(idx.max()) >= n):
            raise InvalidArgument(f"positions_of names chunks past the request's {n}")
        want = np.zeros(n, bool)
        want[idx] = True
        return [], want.tolist()
    return ([], None) if meta.get("positions") else (None, None)


def _broker_flags(flags: int) -> InvalidArgument:
    """A client's chunk flagged as only brokers flag theirs: stored, it would be taken for an
    index or close chunk (or compacted one) by a recovery or a reader."""
    return InvalidArgument(f"chunk flags {flags:#x}: INDEX, CLOSE and COMPACTED are set by brokers "
                           f"only, never in a produced chunk")
