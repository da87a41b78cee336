"""BrokerService: the broker process.

Producer requests carry chunks for many streamlets; each chunk is verified,
appended with one copy into its streamlet's active group, stamped with its
placement, and referenced in its virtual log. The request then waits (for
``acks=all``) until every vlog it touched is durable past its chunks.

This module holds the service's state, streamlet assignment, the produce and
compare-and-append paths and ``main``; the rest is joined in from modules named
after their part of the design: ``pull`` (consume), ``takeover`` (recovery of a
dead broker's streamlets), ``reclaim`` (retention, release, eviction) and
``membership`` (registration, heartbeats, lease, fencing).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import trio

from .. import chunk, door, group_positions, limits, metafile, metrics, wire
from ..coordinator import link
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
    Unavailable,
)
from ..rpc import Later, Pool, advertised
from ..security import secret as secret_
from ..security import tls as tls_
from ..security.credentials import Credentials
from ..security.gate import Gate, take_state
from ..security.mechanisms import BROKER, CLIENT
from ..server import Service
from ..stream_meta import StreamMeta
from ..vlog import BackupSet, VirtualLog, VlogMapping, vlog_id
from .adopted import Claims
from .compactor import Compactor
from .group_close import close_chunk
from .membership import HEARTBEAT, Membership
from .memory import MemoryBudget, default_budget
from .pull import Pulls
from .pull_sessions import PullSessions
from .rebuild import Rebuilder
from .reclaim import Reclaim
from .replicator import ReplicationHub, Replicator
from .segment import VlogChunk
from .streamlet import Ledger, Streamlet
from .takeover import Takeover
from .tiered import TieredReader

log = logging.getLogger("kera.broker")

# flags only brokers set (index, close and compacted chunks): refused in a client's chunk
BROKER_FLAGS = chunk.INDEX | chunk.CLOSE | chunk.COMPACTED


class BrokerService(Takeover, Pulls, Reclaim, Membership, Service):
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
        self.mapping = mapping
        self.vseg_size = vseg_size
        self.replicate_timeout = replicate_timeout
        self.memory = MemoryBudget(memory)
        os.makedirs(data_dir, exist_ok=True)
        self.id_path = os.path.join(data_dir, "broker.id")
        ident = metafile.load(self.id_path) or {}
        self.broker_id: int | None = ident.get("id")
        # what this broker's connections present to the others: a broker, as itself
        self.credentials = Credentials.member(cluster_secret, BROKER, self.broker_id, tls=tls[1])
        self.epoch = 0
        self.addr = ""
        self.advertise = ""        # HOST[:PORT] others reach us at (default: the bound host and port)
        self.streams: dict[int, StreamMeta] = {}
        self.streamlets: dict[tuple[int, int], Streamlet] = {}
        self.ledger = Ledger()     # what is kept over all of them (kera.broker.streamlet)
        self.compactor = Compactor(self.streamlets, self.ledger.compacted, self.memory,
                                   self._free)  # key compaction
        self.vlogs: dict[tuple, Replicator] = {}
        self.backups: dict[int, dict] = {}
        self.backup_set = BackupSet(node)
        self.durable_event = trio.Event()
        self.sessions = PullSessions()   # readers' pull sessions (kera.broker.pull_sessions)
        self.pool: Pool | None = None
        self.nursery: trio.Nursery | None = None
        self.hub: ReplicationHub | None = None   # the incarnation's replication (all its vlogs)
        self.rebuilder: Rebuilder | None = None  # its frozen vsegs' lost copies made again
        self.requests = 0
        self.fenced = False
        self.heartbeat = HEARTBEAT
        self.lease = 0.0           # seconds a heartbeat answer lets us serve
        self.lease_until = 0.0     # monotonic time our lease ends
        self.tiered: TieredReader | None = None
        self.claims: Claims | None = None   # foreign vsegs of adopted segments (kera.broker.adopted)
        self.unsettled: dict[Replicator, int] = {}   # vlog -> its last adoption not yet settled
        self.freed_segments = 0    # by retention or deletion
        self.freed_bytes = 0
        # what producers sent and consumers read (per request and per pull entry, never per record)
        self.records_in = self.bytes_in = self.records_out = self.bytes_out = self.pulls = 0
        self.recoveries_served = 0  # assignments of a dead broker's streamlets to rebuild here
        self.metrics = None        # kera.metrics.broker, with --metrics-port
        self.kafka = None          # kera.kafka's gateway, with --kafka-listener
        self.names: dict[str, int] = {}   # stream name -> id, of the streams held here

    # -- virtual logs ----------------------------------------------------------------
    def notify_durable(self) -> None:
        self.durable_event.set()
        self.durable_event = trio.Event()

    def backup_addr(self, backup_id: int) -> str:
        b = self.backups.get(backup_id)
        if b is None:
            raise Unavailable(f"backup {backup_id} is not alive")
        return b["addr"]

    def backup_damage(self) -> dict[int, int]:
        """Live backup -> how many corrupt chunks it has found on its disk (this incarnation)."""
        return {b: v.get("damage", 0) for b, v in self.backups.items()}

    def vlog_for(self, stream: StreamMeta, streamlet: int, g) -> Replicator:
        """The group's virtual log (chosen on its first chunk, then cached on it)."""
        if g.vlog is not None:
            return g.vlog
        key = self.mapping.key(stream, streamlet, g.id)
        v = self.vlogs.get(key)
        if v is None:
            # ids unique across incarnations: a restarted broker never mixes with its old replicas
            vid = vlog_id(self.epoch, len(self.vlogs))
            vlog = VirtualLog(vid, stream.replication, self.vseg_size, self.backup_set,
                              self.replicate_timeout)
            v = self.vlogs[key] = Replicator(vlog, self.hub, self.notify_durable,
                                             lambda: [(b, m["addr"]) for b, m in self.backups.items()])
        g.vlog = v
        return v

    # -- control -----------------------------------------------------------------
    def _check_epoch(self, meta) -> None:
        if self.fenced or meta.get("epoch") != self.epoch:
            raise Fenced(f"broker {self.broker_id} is at epoch {self.epoch}, request for {meta.get('epoch')}")

    def rpc_assign(self, meta, payload):
        """Streamlets to own; ``recovering`` ones are rebuilt by backups before they serve.

        One stream (``stream``, ``streamlets``) or many (``streams``: [[stream, streamlets],
        ...]): a batch of new streams costs one request per broker.
        """
        self._check_epoch(meta)
        entries = meta.get("streams")
        if entries is None:
            if meta.get("stream") is None or meta.get("streamlets") is None:
                raise InvalidArgument("assign needs a stream and streamlets, or streams")
            entries = [[meta["stream"], meta["streamlets"]]]
        entries = [(StreamMeta.from_wire(s), streamlets) for s, streamlets in entries]
        recovering = meta.get("recovering") is True
        seal = meta.get("seal") is True
        self.recoveries_served += recovering
        backups = meta.get("backups")
        if backups is not None:
            # the coordinator's view as of this stream: its first vsegs get copies on every
            # node, not only on the backups our last heartbeat answer knew of
            self._set_backups(backups)
        for s, streamlets in entries:
            self._assign(s, streamlets, recovering, seal)
        self.notify_durable()  # pulls waiting on these streamlets look again
        return {}

    def _assign(self, s: StreamMeta, streamlets: list, recovering: bool, seal: bool) -> None:
        self.streams[s.id] = s
        self.names[s.name] = s.id
        for i in streamlets:
            sl = self.streamlets.get((s.id, i))
            if sl is not None:
                sl.configure(s)
            if sl is None:
                sl = self.streamlets[(s.id, i)] = Streamlet(s, i, self.memory, self.ledger)
                sl.on_close = self._close_group
                sl.recovering = recovering
            elif sl.recovering and recovering:   # an attempt again: it tells what is pending anew
                sl.forget_pending()
            elif sl.recovering and not recovering:
                sl.finish_recovery()
                if not sl.pending:   # else once its older groups are adopted (``rpc_pend``)
                    self._free(sl.expired(time.time(), settled_only=False))
                if seal:
                    log.error("stream %s streamlet %d: recovered with data lost; its groups are sealed",
                              s.name, i)
                    sl.seal()

    def rpc_configure(self, meta, payload):
        """A stream's changed configuration (retention): applied by the next reclaim pass."""
        self._check_epoch(meta)
        s = StreamMeta.from_wire(meta.get("stream"))
        if s.id in self.streams:
            self.streams[s.id] = s
            for i in range(s.streamlets):   # its streamlets here, not every one held
                sl = self.streamlets.get((s.id, i))
                if sl is not None:
                    sl.configure(s)
        return {}

    def _close_group(self, sl: Streamlet, g, producer: int) -> None:
        """``g`` is full and closed: its close chunk goes to its vlog, after all its chunks."""
        c = close_chunk(sl.stream_id, sl.index, g, producer)
        self._append_close(sl, g, c, chunk.parse_header(c.view).body_checksum)

    def _append_close(self, sl: Streamlet, g, c: VlogChunk, body_checksum: int) -> tuple:
        vlog = self.vlog_for(self.streams[sl.stream_id], sl.index, g)
        return vlog, vlog.append(c, 0, c.head, body_checksum)

    def rpc_unassign(self, meta, payload):
        """Streamlets to drop: of one stream (``stream_id``, ``streamlets``, all if None) or of
        many (``streams``: [[stream id, streamlets or None], ...]). Costs what is dropped,
        not what this broker holds."""
        self._check_epoch(meta)
        entries = meta.get("streams")
        if entries is None:
            if meta.get("stream_id") is None:
                raise InvalidArgument("unassign needs a stream_id, or streams")
            entries = [[meta["stream_id"], meta.get("streamlets")]]
        for sid, only in entries:
            s = self.streams.get(sid)
            if s is None:
                continue
            every = range(s.streamlets)
            for i in every if only is None else only:
                sl = self.streamlets.pop((sid, i), None)
                if sl is not None:
                    self._free(sl.leave())
            if not any((sid, i) in self.streamlets for i in every):
                self.streams.pop(sid, None)
                if self.names.get(s.name) == sid:
                    del self.names[s.name]
        self._reclaim_once()
        return {}

    def rpc_security(self, meta, payload):
        """The users and ACLs, pushed by the coordinator when they change."""
        return take_state(self.gate, meta)

    def rpc_ping(self, meta, payload):
        return {"broker": self.broker_id, "epoch": self.epoch}

    def rpc_kafka_map(self, meta, payload):
        """Kafka offsets of streamlets held here as positions, or back (kera.kafka.offsets)."""
        from ..kafka.offsets import kafka_map
        return kafka_map(self, meta)

    def _check_lease(self) -> None:
        if time.monotonic() > self.lease_until:
            raise Fenced(f"broker {self.broker_id}: no heartbeat answer for too long; not serving")

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

    def _allowed(self, allowed: dict, peer, sid: int, payload, off: int) -> bool:
        """``_may_write``, judged once per stream of a request (but per chunk for commits of
        consumer-group positions, which depend on the chunk's records)."""
        ok = allowed.get(sid)
        if ok is None:
            ok = self._may_write(peer, sid, payload, off)
            s = self.streams.get(sid)
            if s is None or s.name != group_positions.NAME:
                allowed[sid] = ok
        return ok

    def _may_write(self, peer, sid: int, payload, off: int) -> bool:
        """Whether a client may write this chunk, by the ACLs (its stream's, or for a commit
        of consumer-group positions, its records' groups')."""
        s = self.streams.get(sid)
        if s is None:
            return True   # not held here: its own error follows
        if s.name == group_positions.NAME:
            return self._may_commit(peer, payload, off)
        return peer.may("write", "stream", s.name)

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
        allowed: dict[int, bool] = {}   # stream id -> may write (this request's chunks)
        self.requests += 1
        errors = []
        placed = [] if meta.get("positions") else None  # [chunk, group, segment, offset], when asked
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
                        allowed, peer, sid, payload, off)):
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
                chunk.place(seg.view, soff, g.id, seg.id, soff, sl.kafka_base)
                if placed is not None:
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
        for vlog, idx in list(sl.tails.items()):
            await vlog.wait_durable(idx)
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
                                  acl and not self._may_write(peer, h.stream_id, payload, off)):
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
        chunk.place(seg.view, soff, g.id, seg.id, soff, sl.kafka_base)
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
        left = [len(waits)]

        def one(error) -> None:
            if error is not None:
                if left[0] > 0:
                    left[0] = 0
                    later.done(error)
                return
            left[0] -= 1
            if not left[0]:
                later.done(reply)
        for vlog, idx in waits.items():
            vlog.when_durable(idx, one)
        if not waits:
            later.done(reply)
        return later

    @staticmethod
    async def _durable(waits: dict) -> None:
        """Wait until every vlog of ``waits`` is durable up to its index."""
        for vlog, idx in waits.items():
            await vlog.wait_durable(idx)

    # -- stats -------------------------------------------------------------------
    def stats(self) -> dict:
        vl = []
        for r in self.vlogs.values():
            v = r.log
            vl.append({"vlog": v.id, "replication": v.replication, "appended": v.appended,
                       "durable": v.durable, "lag": v.lag(), "messages": v.messages,
                       "failures": v.failures, "give_ups": v.give_ups, **v.copies_held(),
                       "trimmed": r.trimmed, "reclaimed": r.reclaimed})
        t = self.tiered
        return {"memory": self.memory.used, "memory_limit": self.memory.limit,
                "evictions": self.memory.evictions, "evicted_bytes": self.memory.evicted_bytes,
                "freed_segments": self.freed_segments, "freed_bytes": self.freed_bytes,
                "tiered_reads": t.reads if t else 0, "tiered_bytes": t.bytes if t else 0,
                "tiered_seconds": round(t.seconds, 3) if t else 0.0,
                "tiered_cache": t.cached if t else 0,
                "foreign_vsegs": len(self.claims.vsegs) if self.claims else 0,
                "foreign_released": self.claims.released if self.claims else 0,
                "chunks": self.ledger.chunks, "bytes": self.ledger.bytes,
                "streamlets": len(self.streamlets), "requests": self.requests, "vlogs": vl,
                "replication": self.hub.stats() if self.hub else {},
                "rebuild": self.rebuilder.stats() if self.rebuilder else {},
                "compaction": self.compactor.stats(),
                "records_in": self.records_in, "bytes_in": self.bytes_in,
                "records_out": self.records_out, "bytes_out": self.bytes_out, "pulls": self.pulls,
                "recoveries_served": self.recoveries_served,
                "door": self.door.describe(),
                **({"kafka": self.kafka.stats()} if self.kafka is not None else {}),
                **({"metrics": self.metrics.addr} if self.metrics else {})}

    def rpc_vsegs(self, meta, payload):
        """Every virtual segment: [vlog, id, size, closed, the backups holding it (the broker's
        belief: a frozen vseg keeps a departed backup's copy), replication, frozen]."""
        return {"broker": self.broker_id, "vsegs": [
            [v.log.id, vs.id, vs.size, vs.closed, sorted(vs.copies), v.log.replication, vs.frozen]
            for v in self.vlogs.values() for vs in v.log.vsegs]}

    def rpc_stats(self, meta, payload):
        out = {"broker": self.broker_id, **self.stats()}
        if meta.get("streams"):
            out["streams"] = self.retention_stats()
        return out

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.pool = Pool(nursery, credentials=self.credentials)
            self.coord = CoordinatorLink(self.pool, self.coordinator)
            self.claims = Claims(self.pool, lambda: (self.broker_id, self.epoch), self.backup_addr)
            self.tiered = TieredReader(self.pool, lambda: self.broker_id, self.backup_addr,
                                       min(limits.TIERED_CACHE, max(1 << 20, self.memory.limit // 8))
                                       if self.memory.limit else limits.TIERED_CACHE)
            bound = await nursery.start(self.serve, host, port)
            self.addr = advertised(host, bound, self.advertise)
            if self.kafka is not None:   # its address is registered with ours
                await nursery.start(self.kafka.run, self.pool)
            while True:
                await self._register()
                print(f"broker {self.broker_id} listening on {self.addr} (epoch {self.epoch})", flush=True)
                task_status.started(bound)
                task_status = trio.TASK_STATUS_IGNORED
                try:
                    # one incarnation: its vlogs' replication and its heartbeats
                    async with trio.open_nursery() as incarnation:
                        self.nursery = incarnation
                        self.hub = ReplicationHub(self.pool, lambda: (self.broker_id, self.epoch),
                                                  self.backup_addr, self.replicate_timeout)
                        incarnation.start_soon(self.hub.run)
                        self.rebuilder = Rebuilder(self.pool, lambda: (self.broker_id, self.epoch),
                                                   self.backup_addr, self.backup_set,
                                                   lambda: self.vlogs.values(), self.backup_damage)
                        incarnation.start_soon(self.rebuilder.run)
                        incarnation.start_soon(self._heartbeats)
                        incarnation.start_soon(self._reclaimer)
                        incarnation.start_soon(self._releaser)
                        incarnation.start_soon(self.compactor.run)
                except* Fenced:
                    log.error("broker %d epoch %d fenced: dropping its state, joining again",
                              self.broker_id, self.epoch)
                self._reset()


def _broker_flags(flags: int) -> InvalidArgument:
    """A client's chunk flagged as only brokers flag theirs: stored, it would be taken for an
    index or close chunk (or compacted one) by a recovery or a reader."""
    return InvalidArgument(f"chunk flags {flags:#x}: INDEX, CLOSE and COMPACTED are set by brokers "
                           f"only, never in a produced chunk")


def _vseg_size(text: str) -> int:
    n = int(text)
    if not 0 < n <= limits.MAX_VSEG_SIZE:
        raise argparse.ArgumentTypeError(f"must be 1..MAX_VSEG_SIZE ({limits.MAX_VSEG_SIZE}), not {n}")
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kera broker")
    ap.add_argument("--coordinator", default=os.environ.get(link.ENV, link.DEFAULT))
    ap.add_argument("--data", default="kera-data/broker")
    ap.add_argument("--node", default="")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                    help="address clients and the coordinator reach this broker at (default: "
                         "--host and the port bound)")
    ap.add_argument("--vlogs", type=int, default=4, help="virtual logs per broker (shared policy)")
    ap.add_argument("--vlog-policy", default="shared", choices=["shared", "per-stream", "per-group"])
    ap.add_argument("--vseg-size", type=_vseg_size, default=limits.DEFAULT_VSEG_SIZE,
                    help=f"virtual segment capacity, bytes (at most MAX_VSEG_SIZE, {limits.MAX_VSEG_SIZE})")
    ap.add_argument("--memory", type=int, default=None,
                    help="bytes of segments this broker keeps in memory; older replicated ones are "
                         "evicted and read back from backups (default: a quarter of the machine's "
                         "RAM; 0: no limit)")
    ap.add_argument("--replicate-timeout", type=float, default=5.0,
                    help="seconds before a silent backup is replaced")
    metrics.add_arguments(ap)
    ap.add_argument("--metrics-top-streams", type=int, default=0, metavar="N",
                    help="per-stream series for the N streams with the most bytes in (default 0: "
                         "none; finding them walks the broker's streamlets at each scrape)")
    secret_.add_arguments(ap)
    tls_.add_arguments(ap)
    door.add_arguments(ap)
    ap.add_argument("--kafka-listener", default=None, metavar="HOST:PORT",
                    help="also serve Kafka's wire protocol here (port 0 picks a free one)")
    ap.add_argument("--kafka-advertise", default="", metavar="HOST[:PORT]",
                    help="the address Kafka clients are told to reach this broker at "
                         "(default: the listener's host and port)")
    args = ap.parse_args(argv)
    cluster_secret = secret_.from_args(ap, args)
    tls = tls_.from_args(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s broker %(levelname)s %(message)s")
    svc = BrokerService(args.coordinator, args.data, args.node or f"{os.uname().nodename}-{os.getpid()}",
                        VlogMapping(args.vlog_policy, args.vlogs), args.vseg_size,
                        args.replicate_timeout,
                        default_budget() if args.memory is None else args.memory,
                        cluster_secret=cluster_secret, auth=args.auth,
                        door=Door(door.from_args(args)), tls=tls)
    svc.advertise = args.advertise
    if args.kafka_listener is not None:
        from ..kafka.gateway import Gateway
        svc.kafka = Gateway(svc, args.kafka_listener, args.kafka_advertise)
    if args.metrics_port is not None:
        from ..metrics.broker import install
        install(svc, args.metrics_top_streams)

    async def run():
        async with trio.open_nursery() as n:
            if svc.metrics is not None:
                await n.start(svc.metrics.serve, args.metrics_host or args.host, args.metrics_port)
            await svc.run(args.host, args.port)

    from ..process import run_until_signal
    run_until_signal(run)
