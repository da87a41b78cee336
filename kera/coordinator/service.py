"""The coordinator: stream metadata, placement, recovery, and leadership.

Metadata (streams, streamlet owners, identities, fences) lives in
``self.meta``, kept by a ``MetaLog`` in the data dir or by ``EtcdMeta`` in
etcd: each change is recorded as it is made, and a request whose change must
survive a crash awaits ``commit()`` before it answers (one write for many
requests). Membership and failure detection (soft state) are
in ``kera.coordinator.membership``; with etcd, this process serves only while it leads.
Consumer-group positions are not metadata: they are records of an internal
stream (``kera.group_positions``) that this process only creates.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import trio

from .. import door, group_positions, limits, meta_columns, metrics, wire
from ..door import Door
from ..errors import (
    InvalidArgument,
    InvalidName,
    KeraError,
    LimitExceeded,
    NotEnoughBackups,
    NotLeader,
    StreamExists,
    Unavailable,
    UnknownStream,
)
from ..names import check_stream_name, is_internal
from ..recovery.adoption import Adoptions
from ..recovery.manager import RecoveryManager
from ..recovery.repoint import CHUNK_ROWS_NEWEST
from ..rpc import Pool
from ..security import secret as secret_
from ..security import tls as tls_
from ..security.accounts import Accounts
from ..security.credentials import Credentials
from ..security.gate import Gate
from ..security.mechanisms import COORDINATOR, MEMBER
from ..server import Service
from ..stream_meta import StreamMeta
from . import etcd
from .catalog import Catalog, Page
from .etcd_store import Election, EtcdMeta
from .membership import Member, Membership
from .metalog import MetaLog
from .recovered import Recovered

log = logging.getLogger("kera.coordinator")

INITIAL = {   # the metadata of a new cluster
    "next_stream_id": 1, "next_producer_id": 1, "next_epoch": 1,
    "next_id": {"broker": 1, "backup": 1}, "streams": {},
    "backups": [],   # every backup id ever registered
    "fences": {},    # broker id -> newest epoch fenced
    "recovered": [],  # [[broker, epoch, version], ...] recovered with nothing lost (kera.coordinator.recovered)
    "recovered_version": 0,
    "deferred": {},   # "broker:epoch" -> closed history adopted after its hand-over (kera.recovery.adoption)
    "users": {},      # name -> salted SCRAM keys (kera.security.accounts)
    "acls": [],       # [principal, permission, operation, resource, name, pattern], ...
    "security_version": 0,
}

DEFAULTS = {
    "streamlets": 1,
    "groups": 1,
    "replication": 3,
    "segment_size": 1 << 20,
    "group_segments": 8,
}
PACKED = ("streams",)   # kept as each entry's msgpack bytes by the store (kera.coordinator.catalog)
VLOG_POLICIES = ("shared", "per-stream", "per-group")
# retention, Kafka's names and meaning (-1: unbounded); the cluster's defaults are the
# coordinator's --retention-bytes / --retention-ms. retention_bytes is the stream's total.
RETENTION = {"retention_bytes": "retention.bytes", "retention_ms": "retention.ms"}
RETENTION_DEFAULTS = {"retention_bytes": -1, "retention_ms": -1}


def _retention(spec: dict) -> dict:
    """The retention settings a spec gives (either spelling), checked: -1 or >= 0."""
    out = {}
    for key, kafka in RETENTION.items():
        v = spec.get(key, spec.get(kafka))
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < -1:
            raise InvalidArgument(f"{kafka} must be an integer >= 0, or -1 for unbounded, not {v!r}")
        out[key] = v
    return out


# key compaction, Kafka's names and meaning: cleanup.policy, delete.retention.ms (tombstones),
# segment.ms (a compacted stream's newest segment is rolled, and so compacted, after it)
CLEANUP = {"cleanup_policy": "cleanup.policy", "delete_retention_ms": "delete.retention.ms",
           "segment_ms": "segment.ms"}
CLEANUP_POLICIES = ("delete", "compact", "compact,delete")


def _cleanup_policy(spec: dict, groups: int = 1) -> dict:
    """The compaction settings a spec gives (either spelling), checked. Compaction keeps the
    last record per key in a streamlet's one order, so a compacted stream has one active
    group per streamlet (``groups`` > 1 would let two producers' writes of a key race)."""
    out = {}
    for key, kafka in CLEANUP.items():
        v = spec.get(key, spec.get(kafka))
        if v is None:
            continue
        if key == "cleanup_policy":
            v = ",".join(sorted(p.strip() for p in v.split(","))) if isinstance(v, str) else v
            if v not in CLEANUP_POLICIES:
                raise InvalidArgument(f"{kafka} must be one of {', '.join(CLEANUP_POLICIES)}, not {v!r}")
        elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidArgument(f"{kafka} must be an integer >= 0, not {v!r}")
        out[key] = v
    if "compact" in out.get("cleanup_policy", "") and groups > 1:
        raise InvalidArgument(f"cleanup.policy {out['cleanup_policy']} needs groups=1 (one order per "
                              f"streamlet for the latest record of a key), not {groups}")
    return out


def _batches(entries: list) -> list[list]:
    """[[stream, streamlets], ...] cut into parts that each fit one request's meta."""
    parts: list[list] = [[]]
    streamlets = 0
    for entry in entries:
        n = len(entry[1])
        if parts[-1] and (len(parts[-1]) == limits.MAX_BATCH_STREAMS
                          or streamlets + n > limits.MAX_BATCH_STREAMLETS):
            parts.append([])
            streamlets = 0
        parts[-1].append(entry)
        streamlets += n
    return parts


def _check_stream_limits(cfg: dict) -> None:
    """A stream's shape within ``kera.limits``; refused with the limit's name otherwise."""
    for key, name, high in (("streamlets", "MAX_STREAMLETS", limits.MAX_STREAMLETS),
                            ("groups", "MAX_GROUPS", limits.MAX_GROUPS),
                            ("segment_size", "MAX_SEGMENT_SIZE", limits.MAX_SEGMENT_SIZE)):
        if cfg[key] > high:
            raise LimitExceeded(f"{key} {cfg[key]} exceeds {name} ({high})",
                                limit=name, bound=high, size=cfg[key])
    if cfg["segment_size"] < limits.MIN_SEGMENT_SIZE:
        raise LimitExceeded(f"segment_size {cfg['segment_size']} is below MIN_SEGMENT_SIZE "
                            f"({limits.MIN_SEGMENT_SIZE})", limit="MIN_SEGMENT_SIZE",
                            bound=limits.MIN_SEGMENT_SIZE, size=cfg["segment_size"])


def _as_stored(d: dict) -> dict:
    return d


def _describes(peer):
    """Whether ``peer`` may describe a stream of this name: a listing's filter."""
    return lambda name: peer.may("describe", "stream", name)


class Coordinator(Membership, Service):
    """``metadata``: None for the embedded store (a ``MetaLog`` in ``data_dir``), or
    ``etcd://HOST:PORT[,...][/prefix]``: the state lives in etcd and this coordinator
    leads only while it holds the election there (``addr`` is what it advertises);
    otherwise it stands by, answering ``not_leader`` with the leader's address."""

    rpcs = wire.COORDINATOR_RPCS

    def __init__(self, data_dir: str, dead_after: float = 2.0, expect_nodes: int = 0,
                 metadata: str | None = None, addr: str = "", *, cluster_secret: bytes,
                 auth: bool = False, super_users=(), door: Door | None = None, tls=(None, None)):
        """``tls``: (the listener's context, the context to open TLS to members with)."""
        self.data_dir = data_dir
        self.cluster_secret = cluster_secret
        self.tls, self.member_tls = tls
        self.gate = Gate(cluster_secret, auth=auth, super_users=super_users)
        self.door = door or Door()
        self.dead_after = dead_after
        self.repoint_evicted = True  # recovery re-points settled history (kera.recovery.repoint)
        self.chunk_rows_newest = CHUNK_ROWS_NEWEST   # bytes per vlog indexed per chunk (the rest as runs)
        self.lease = dead_after * 0.75   # how long a heartbeat answer lets a broker serve
        self.expect_nodes = expect_nodes  # a local cluster's size: not ready before it is complete
        self.addr = addr
        self.pool: Pool | None = None
        self.log = None
        self.leading = False
        self.terms = 0                    # times this process became the leader
        self.metrics = None               # kera.metrics.coordinator, with --metrics-port
        self.metadata = metadata or f"local:{os.path.abspath(data_dir)}"
        if metadata:
            endpoints, prefix = etcd.parse_url(metadata)
            self.etcd = etcd.Etcd(endpoints)
            self.election = Election(self.etcd, prefix, addr)
            self.store = lambda: EtcdMeta(self.etcd, prefix, self.election, INITIAL, packed=PACKED)
            self.rejoin_wait = 2 * dead_after   # after a takeover, brokers find the new leader
        else:
            os.makedirs(data_dir, exist_ok=True)
            self.etcd = self.election = None
            self.rejoin_wait = dead_after
            self._begin_term(MetaLog(data_dir, INITIAL, legacy=os.path.join(data_dir, "coordinator.meta"),
                                     packed=PACKED))

    def _begin_term(self, store) -> None:
        """Lead with ``store``'s state: membership starts empty, servers (re)register."""
        self.log = store
        self.meta = store.state   # changed only through self.log
        # meta["streams"] (each stream's map, packed), decoded on demand, and its indexes
        self.streams = Catalog(store)
        self.holdings = self.streams.holdings   # incarnation -> streamlets
        if "positions" in self.meta:   # group positions of an older version: they start afresh
            log.warning("dropping the positions of %d consumer groups committed by an older "
                        "version: those groups start afresh", len(self.meta["positions"] or {}))
            store.delete(("positions",))
        self._creating = trio.Lock()   # an internal stream, on first use
        self._deleting: dict[int, list] = {}   # stream id -> owners to unassign, moved by set_owner
        self.members: dict[str, dict[int, Member]] = {"broker": {}, "backup": {}}
        # broker incarnations replaced by a newer registration, kept until recovered
        self.departed: dict[tuple[int, int], Member] = {}
        self.suspect_since: float | None = None   # every member went silent at once (membership)
        self.last_heard = time.monotonic()          # from any member
        self.started = time.monotonic()
        self.ready = self.expect_nodes == 0
        self.changed = trio.Event()
        self.recovery = RecoveryManager(self, grace=max(30.0, 10 * self.dead_after))
        self.recovered = Recovered(self)
        self.adoptions = Adoptions(self)
        self.accounts = Accounts(store, self.gate, self.commit, self._member_addrs, lambda: self.pool)
        self.leading = True
        self.terms += 1

    def lookup(self, method):
        h = super().lookup(method)
        if not self.leading and method not in ("ping", "authenticate"):
            raise NotLeader(f"coordinator {self.addr} stands by", leader=self._leader_hint())
        return h

    def rpc_authenticate(self, meta, payload, peer):
        """A standby admits members (they are sent on as any request is); users, whose keys
        only the leader holds, are sent to the leader at once."""
        if not self.leading and peer.handshake is None and meta.get("mechanism") != MEMBER:
            raise NotLeader(f"coordinator {self.addr} stands by", leader=self._leader_hint())
        return super().rpc_authenticate(meta, payload, peer)

    def _member_addrs(self) -> list[str]:
        return [m.addr for role in ("broker", "backup") for m in self.members[role].values() if m.alive]

    # -- users and ACLs (kera.security.accounts) -----------------------------------
    async def rpc_user_add(self, meta, payload):
        return await self.accounts.user_add(meta)

    async def rpc_user_delete(self, meta, payload):
        return await self.accounts.user_delete(meta)

    def rpc_user_list(self, meta, payload):
        return self.accounts.user_list(meta)

    async def rpc_acl_add(self, meta, payload):
        return await self.accounts.acl_add(meta)

    async def rpc_acl_remove(self, meta, payload):
        return await self.accounts.acl_remove(meta)

    def rpc_acl_list(self, meta, payload):
        return self.accounts.acl_list(meta)

    def _leader_hint(self) -> str:
        hint = self.election.leader if self.election is not None else ""
        return "" if hint == self.addr else hint

    def rpc_ping(self, meta, payload):
        return {"leading": self.leading}

    # -- persistence -----------------------------------------------------
    async def commit(self) -> None:
        """Until every metadata change made so far is on disk."""
        recovered = self.meta["recovered_version"]
        t0 = time.perf_counter()
        await self.log.commit()
        if self.metrics is not None:
            self.metrics.commit.observe(time.perf_counter() - t0)
        self.recovered.durable(recovered)

    def fence(self, broker: int, epoch: int) -> None:
        """From now on, no backup accepts replicas of ``broker`` from ``epoch`` or older
        (durable once ``commit`` returns)."""
        k = str(broker)
        if self.meta["fences"].get(k, 0) < epoch:
            self.log.set(("fences", k), epoch)

    def set_owner(self, s: StreamMeta, i: int, m: Member) -> None:
        """Streamlet ``i`` of ``s`` is now ``m``'s (durable once ``commit`` returns)."""
        now = self.streams.get(s.name)
        if now is None or now.id != s.id:   # deleted (or re-created) meanwhile: nothing to keep
            if s.id in self._deleting:      # (a delete still committing unassigns it from m too)
                self._deleting[s.id][i] = (m.id, m.epoch)
            return
        self.streams.set_owner(now, i, (m.id, m.epoch))

    def _take(self, counter: str) -> int:
        v = self.meta[counter]
        self.log.set((counter,), v + 1)
        return v

    # -- streams -----------------------------------------------------------
    def _describe(self, s: StreamMeta) -> dict:
        """A stream with the address of each streamlet's owner (None while it is recovered)."""
        return self._addressed(self._wire(s))

    def _addressed(self, d: dict) -> dict:
        """Stream map ``d`` (the caller's), with ``addrs``: each streamlet's owner's address."""
        addrs = []
        for b, e in d["owners"]:
            m = self.live_broker(b, e)
            addrs.append(m.addr if m is not None else None)
        d["addrs"] = addrs
        return d

    def _now(self, s: StreamMeta) -> StreamMeta:
        """``s`` as it is now (altered or moved since it was read), unless it was deleted."""
        now = self.streams.get(s.name)
        return now if now is not None and now.id == s.id else s

    def _wire(self, s: StreamMeta) -> dict:
        """``s``'s map as it is now (altered or moved since it was read: as the store holds
        it), or ``s.to_wire()`` once deleted."""
        d = self.streams.wire(s.name)
        return d if d is not None and d["id"] == s.id else s.to_wire()

    def _stream(self, name) -> StreamMeta:
        s = self.streams.get(name) if isinstance(name, str) else None
        if s is None:
            raise UnknownStream(f"no stream named {name!r}")
        return s

    def _user_stream(self, name) -> StreamMeta:
        """A stream a user may change: internal ones are kera's."""
        s = self._stream(name)
        if is_internal(name):
            raise InvalidName(f"stream {name!r} is internal: it cannot be deleted or altered")
        return s

    async def rpc_create_stream(self, meta, payload):
        """One stream: the batch path with one entry."""
        s, = await self._create([meta])
        return {"stream": self._describe(s)}

    async def rpc_create_streams(self, meta, payload, peer):
        """Many streams in one request, all or none: ``{"streams": [spec, ...]}``, each spec
        shaped like ``create_stream``'s request. Answers their ids, in order. A client must
        be allowed to create every one of them (else none is)."""
        specs = meta["streams"]
        for i, spec in enumerate(specs):
            if isinstance(spec.get("name"), str) and not peer.may("create", "stream", spec["name"]):
                try:
                    peer.require("create", "stream", spec["name"])
                except KeraError as e:
                    e.index, e.stream = i, spec["name"]
                    raise
        return {"ids": [s.id for s in await self._create(specs)]}

    def _config(self, spec, nodes: int, internal: bool = False) -> tuple[str, dict]:
        """One spec's name and shape, defaults filled in; refused if invalid, taken or too large.
        ``internal``: one of kera's own streams, whose name a user's cannot be."""
        if not isinstance(spec, dict):
            raise InvalidArgument("a stream spec must be a map")
        name = spec["name"] if internal else check_stream_name(spec.get("name"))
        if name in self.streams:
            raise StreamExists(f"stream {name!r} exists")
        cfg = {}
        for key, default in DEFAULTS.items():
            v = spec.get(key)
            v = default if v is None else v
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"{key} must be a positive integer")
            cfg[key] = v
        _check_stream_limits(cfg)
        policy = spec.get("vlogs")
        if policy is not None and policy not in VLOG_POLICIES:
            raise InvalidArgument(f"vlogs must be one of {', '.join(VLOG_POLICIES)}")
        cfg["vlogs"] = policy
        cfg.update({**getattr(self, "retention_defaults", RETENTION_DEFAULTS), **_retention(spec)})
        cfg.update({"cleanup_policy": "delete", **_cleanup_policy(spec, cfg["groups"])})
        if spec.get("replication") is None:
            cfg["replication"] = min(cfg["replication"], max(1, nodes))
        if cfg["replication"] > nodes:
            raise NotEnoughBackups(
                f"replication {cfg['replication']} needs {cfg['replication']} nodes, {nodes} alive")
        return name, cfg

    async def _create(self, specs: list, internal: bool = False) -> list[StreamMeta]:
        """Create all of ``specs`` or none of them, with one commit and one assign per broker.

        Every spec is checked before anything is recorded, with no await in between, so
        a refused batch leaves no trace; the error carries ``index`` and ``stream`` (the
        entry's name) and, in a batch of several, says which entry it is.
        """
        await self.wait_ready()
        if not any(m.alive for m in self.members["broker"].values()):
            raise NotEnoughBackups("no live broker to place the stream on")
        nodes = len(self._nodes())
        checked: dict[str, dict] = {}
        for i, spec in enumerate(specs):
            try:
                name, cfg = self._config(spec, nodes, internal)
                if name in checked:
                    raise InvalidArgument(f"stream {name!r} is named twice in the batch")
            except KeraError as e:
                e.index = i
                if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                    e.stream = spec["name"]
                if len(specs) > 1:
                    e.args = (f"streams[{i}]: {e}",)
                raise
            checked[name] = cfg
        total = sum(cfg["streamlets"] for cfg in checked.values())
        if total > limits.MAX_BATCH_STREAMLETS:
            raise LimitExceeded(f"{total} streamlets in one batch exceed MAX_BATCH_STREAMLETS "
                                f"({limits.MAX_BATCH_STREAMLETS})", limit="MAX_BATCH_STREAMLETS",
                                bound=limits.MAX_BATCH_STREAMLETS, size=total)
        created = []
        now = time.time()
        loads = self.loads()
        for name, cfg in checked.items():
            sid = self._take("next_stream_id")
            owners = tuple([(m.id, m.epoch) for m in self.spread(cfg["streamlets"], sid, loads)])
            s = StreamMeta(name=name, id=sid, **cfg, owners=owners, created=now)
            self.streams.create(s, listed=not internal)
            created.append(s)
        await self.commit()
        await self._assign(created)
        if len(created) == 1:
            log.info("created stream %s (id %d, %d streamlets)", created[0].name, created[0].id, total)
        else:
            log.info("created %d streams (ids %d-%d, %d streamlets)", len(created), created[0].id,
                     created[-1].id, total)
        return created

    def loads(self) -> tuple[list[Member], dict[int, int]]:
        """The live brokers and the streamlets each one's incarnation owns."""
        brokers = sorted((m for m in self.members["broker"].values() if m.alive), key=lambda m: m.id)
        if not brokers:
            raise NotEnoughBackups("no live broker")
        return brokers, {m.id: self.holdings.count((m.id, m.epoch)) for m in brokers}

    def spread(self, n: int, salt: int = 0, loads: tuple | None = None) -> list[Member]:
        """n owners among live brokers, each time the least loaded (streamlets its
        incarnation owns). ``loads``: those of ``loads()``, counted on by each call (a batch of
        creates takes them once, not once per stream)."""
        brokers, load = loads or self.loads()
        out = []
        for _i in range(n):
            m = min(brokers, key=lambda m: (load[m.id], (m.id + salt) % len(brokers)))
            load[m.id] += 1
            out.append(m)
        return out

    async def assign(self, m: Member, entries: list, recovering: bool = False, seal: bool = False) -> None:
        """Tell ``m`` it owns ``entries`` ([[StreamMeta, [streamlet, ...]], ...]), in as few
        requests as a frame allows. ``seal``: the recovery of these streamlets lost data; their
        groups are closed."""
        backups = self.tell_backups(m)
        for part in _batches(entries):
            streams = [[self._wire(s), sl] for s, sl in part]
            await self.pool.call(m.addr, "assign", {"epoch": m.epoch, "streams": streams, "recovering": recovering,
                                                    "seal": seal, "backups": backups}, timeout=10)

    async def _assign(self, streams: list[StreamMeta]) -> None:
        """Tell each owner broker about its streamlets of ``streams``: one request per broker,
        all in parallel."""
        by_broker: dict[tuple, list] = {}
        for s in streams:
            mine: dict[tuple, list[int]] = {}
            for i, (b, e) in enumerate(s.owners):
                mine.setdefault((b, e), []).append(i)
            for key, sl in mine.items():
                by_broker.setdefault(key, []).append([s, sl])

        async def one(bid, epoch, entries):
            m = self.live_broker(bid, epoch)
            if m is None:
                return
            try:
                await self.assign(m, entries)
            except KeraError as e:
                log.warning("assigning %d streams to broker %d failed: %s", len(entries), bid, e)

        async with trio.open_nursery() as n:
            for (bid, epoch), entries in by_broker.items():
                n.start_soon(one, bid, epoch, entries)

    def rpc_list_streams(self, meta, payload, peer):
        """One page of the streams matching ``pattern`` (all if None) that the caller may
        describe, in name order, from just after ``after``: at most ``limit`` (``MAX_LIST_PAGE``) streams and
        ``MAX_LIST_PAGE_STREAMLETS`` streamlets. ``next`` is the ``after`` of the next page,
        None once the listing is complete (a page may be empty and still have a next)."""
        pattern, after = meta.get("pattern"), meta.get("after")
        page = Page(meta.get("limit") or limits.MAX_LIST_PAGE)
        nxt = self.streams.listing(page, self._addressed, pattern, after, visible=_describes(peer))
        return {"streams": page.streams, "next": nxt}

    def rpc_metadata(self, meta, payload, peer):
        """Where streams live, a page (as ``list_streams``'s) at a time: the streams ``names``
        (at most ``MAX_LIST_PAGE``; the unknown ones in ``missing``), then those matching
        ``pattern``: from just after ``after`` in name order or, with ``since`` (a stream id),
        those created after it, in id order (a subscription's new streams: what was created
        since, not every name again). ``more``: how many names (the last ones) did not fit,
        to ask again; the pattern is begun only once every name is answered, and ``next`` is
        the ``after`` (or ``since``) of its next page (None once complete, or with no
        pattern). Only the streams the caller may describe are answered (a name it may not is
        refused). ``top``: the newest stream id, where a later ``since`` may start. Every
        answer fits a frame, however many streams are asked for (``kera_client.metadata``)."""
        names = meta.get("names") or []
        pattern, after, since = meta.get("pattern"), meta.get("after"), meta.get("since")
        for name in names:
            peer.require("describe", "stream", name)
        visible = _describes(peer)
        page = Page(meta.get("limit") or limits.MAX_LIST_PAGE)
        # ``columns``: the page as ``kera.meta_columns`` (the maps, addressed there), not maps
        describe = _as_stored if meta.get("columns") else self._addressed
        out = {"streams": page.streams, "missing": [], "more": 0, "next": None,
               "top": self.meta["next_stream_id"] - 1}
        for k, name in enumerate(names):
            d = self.streams.wire(name)
            if d is None:
                out["missing"].append(name)
            elif page.fits(d["streamlets"]):
                page.add(describe(d))
            else:
                out["more"] = len(names) - k
                out["next"] = (after if since is None else since) if pattern else None
                return self._columns(out, meta)
        if pattern and since is not None:
            out["next"] = self.streams.created(page, describe, pattern, since, visible)
        elif pattern:
            out["next"] = self.streams.listing(page, describe, pattern, after,
                                               skip=set(names), visible=visible)
        return self._columns(out, meta)

    def _columns(self, out: dict, meta) -> dict:
        """A metadata answer's streams as columns, if they were asked so."""
        if meta.get("columns"):
            out["columns"] = meta_columns.encode(out.pop("streams"), self._live_addr)
        return out

    def _live_addr(self, broker: int, epoch: int) -> str | None:
        m = self.live_broker(broker, epoch)
        return m.addr if m is not None else None

    def rpc_describe_stream(self, meta, payload):
        return {"stream": self._describe(self._stream(meta.get("name")))}

    async def rpc_delete_stream(self, meta, payload):
        s = self._user_stream(meta.get("name"))
        self.streams.delete(s)
        owners = self._deleting[s.id] = list(s.owners)
        try:
            await self.commit()
        finally:
            del self._deleting[s.id]

        async def one(bid, epoch):
            m = self.live_broker(bid, epoch)
            if m is not None:
                try:
                    await self.pool.call(m.addr, "unassign", {"epoch": epoch, "stream_id": s.id},
                                         timeout=10)
                except KeraError as e:
                    log.warning("unassign on broker %d failed: %s", bid, e)

        async with trio.open_nursery() as n:
            for bid, epoch in set(owners):
                n.start_soon(one, bid, epoch)
        return {"deleted": s.name}

    async def rpc_alter_stream(self, meta, payload):
        """Change a stream's retention (``retention_bytes`` / ``retention_ms``) or compaction
        (``cleanup_policy``, ``delete_retention_ms``, ``segment_ms``), or Kafka's dotted names:
        persisted, then pushed to the brokers owning its streamlets, which apply it at their
        next pass. Refused as a whole if any value is invalid."""
        s = self._user_stream(meta.get("name"))
        changes = {**_retention(meta), **_cleanup_policy(meta, s.groups)}
        if not changes:
            raise InvalidArgument("alter_stream needs retention_bytes, retention_ms, cleanup_policy, "
                                  "delete_retention_ms and/or segment_ms")
        altered = self.streams.alter(s, changes)
        await self.commit()
        s = self._now(altered)   # moved meanwhile: its owners now

        async def one(bid, epoch):
            m = self.live_broker(bid, epoch)
            if m is not None:
                try:
                    await self.pool.call(m.addr, "configure", {"epoch": m.epoch, "stream": self._wire(s)}, timeout=10)
                except KeraError as e:  # it gets the stream again with its next assign
                    log.warning("configure on broker %d failed: %s", bid, e)

        async with trio.open_nursery() as n:
            for bid, epoch in set(s.owners):
                n.start_soon(one, bid, epoch)
        log.info("stream %s: %s", s.name, changes)
        return {"stream": self._describe(s)}

    async def rpc_producer_id(self, meta, payload, peer):
        """A new producer id, never given before, and its token: bound to the caller's
        principal, so that no one else may write under it (``Peer.bind_producer``)."""
        pid = self._take("next_producer_id")
        await self.commit()
        return {"id": pid, "token": self.gate.producer_token(pid, peer.principal)}

    # -- consumer positions ----------------------------------------------
    async def rpc_positions_stream(self, meta, payload):
        """The internal stream consumer groups commit their positions to, created on first
        use (``kera.group_positions``): the coordinator never sees a commit."""
        async with self._creating:
            s = self.streams.get(group_positions.NAME)
            if s is None:
                s, = await self._create([{"name": group_positions.NAME, **group_positions.SHAPE}],
                                        internal=True)
        return {"stream": self._describe(s)}

    # -- status -----------------------------------------------------------
    async def rpc_status(self, meta, payload):
        if not self.ready:
            raise Unavailable(f"cluster starting: {self._complete_nodes()} of {self.expect_nodes} nodes up")

        def members(role):
            return [{**m.describe(), "stats": m.stats} for m in self.members[role].values()]

        standbys = []
        if self.election is not None:
            with trio.move_on_after(2):
                standbys = await self.election.standbys()
        # streams by count only: their list is list_streams' job (it may be long)
        return {"brokers": members("broker"), "backups": members("backup"),
                "streams": len(self.streams), "recoveries": self.recovery.describe(),
                "recovered": self.recovered.describe(), "adoptions": self.adoptions.describe(),
                "coordinators": {"leader": self.addr, "standbys": standbys, "store": self.metadata,
                                 "terms": self.terms,
                                 **({"metrics": self.metrics.addr} if self.metrics else {})},
                **({"consumer_lag": self.metrics.lag.rows} if self.metrics else {})}

    # -- leading ----------------------------------------------------------
    async def _lead(self, hold=None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """This term's tasks; with ``hold`` (etcd), until it returns: leadership lost."""
        async with trio.open_nursery() as n:
            await n.start(self.log.run)
            n.start_soon(self.watch)
            n.start_soon(self.recovery.run)
            n.start_soon(self.adoptions.run)
            if not self.ready and self.meta["backups"]:
                n.start_soon(self._ready_after, self.rejoin_wait)
            task_status.started()
            if hold is not None:
                await hold()
                n.cancel_scope.cancel()

    async def _ready_after(self, delay: float) -> None:
        """A cluster that existed before this term: its nodes had their time to rejoin."""
        await trio.sleep(delay)
        if not self.ready:
            log.info("%d of %d nodes rejoined; serving", self._complete_nodes(), self.expect_nodes)
            self.ready = True
            self._notify()

    async def _terms(self) -> None:
        """Stand by until elected, lead until the lease is lost, and again."""
        while True:
            await self.election.campaign()
            store = self.store()
            try:
                await store.load()
            except etcd.EtcdError as err:
                log.warning("could not load the metadata after the election: %s", err)
                self.election.revision = 0
                continue
            self._begin_term(store)
            log.info("coordinator %s leads (term %d): %d streams", self.addr, self.terms,
                     len(self.streams))
            try:
                await self._lead(self.election.hold)
            except* NotLeader:
                pass
            finally:
                self.leading = False
                store.close()
            log.warning("coordinator %s stopped leading", self.addr)

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED):
        try:
            async with trio.open_nursery() as nursery:
                self.pool = Pool(nursery, credentials=Credentials.member(
                    self.cluster_secret, COORDINATOR, tls=self.member_tls))
                if self.election is None:
                    await nursery.start(self._lead)
                    bound = await nursery.start(self.serve, host, port)
                    self.addr = self.addr or f"{host}:{bound}"
                else:
                    bound = await nursery.start(self.serve, host, port)
                    self.addr = self.election.addr = self.addr or f"{host}:{bound}"
                    nursery.start_soon(self._terms)
                task_status.started(bound)
        finally:
            if self.election is not None:
                await self.election.resign()   # standbys take over now, not after the lease
                with trio.CancelScope(shield=True, deadline=trio.current_time() + 1):
                    await self.etcd.aclose()
            elif self.log is not None:
                self.log.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kera coordinator")
    ap.add_argument("--data", default="kera-data/coordinator")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7700)
    ap.add_argument("--dead-after", type=float, default=2.0, help="seconds without heartbeat")
    ap.add_argument("--expect-nodes", type=int, default=0,
                    help="answer status only once this many nodes (broker + backup) are up")
    ap.add_argument("--metadata", default=os.environ.get("KERA_METADATA"),
                    help="etcd://HOST:PORT[,HOST:PORT...][/prefix]: keep metadata in etcd and lead "
                         "only while elected there (default: a log in --data)")
    ap.add_argument("--advertise", default="", help="HOST:PORT others reach this coordinator at "
                    "(default: --host:--port)")
    ap.add_argument("--repoint-evicted", action=argparse.BooleanOptionalAction, default=True,
                    help="recovery hands a dead broker's settled segments to their new owners as "
                         "evicted segments read from the backups' copies, instead of replaying "
                         "them (default; --no-repoint-evicted replays everything retained)")
    ap.add_argument("--chunk-rows-newest", type=int, default=CHUNK_ROWS_NEWEST, metavar="BYTES",
                    help="a recovery plans each vlog's settled history from runs of chunks, but for "
                         "its newest BYTES, where the groups it continues mostly lie, from a row per "
                         "chunk (default 8 MiB; 0: runs throughout)")
    ap.add_argument("--retention-bytes", type=int, default=-1,
                    help="default retention.bytes of new streams (-1: unbounded)")
    ap.add_argument("--retention-ms", type=int, default=-1,
                    help="default retention.ms of new streams (-1: unbounded)")
    metrics.add_arguments(ap)
    ap.add_argument("--metrics-lag-interval", type=float, default=2.0, metavar="SECONDS",
                    help="how often consumer groups' lag is measured for the metrics")
    ap.add_argument("--metrics-top-groups", type=int, default=100, metavar="N",
                    help="lag series for the N (group, stream) pairs with the most lag")
    secret_.add_arguments(ap)
    ap.add_argument("--super-users", default="", metavar="PRINCIPALS",
                    help="User:NAME[,User:NAME...]: principals that bypass ACLs (with --auth)")
    tls_.add_arguments(ap)
    door.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.chunk_rows_newest < 0:   # before anything is created
        ap.error("--chunk-rows-newest is a number of bytes, 0 or more")
    cluster_secret = secret_.from_args(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    addr = args.advertise or (f"{args.host}:{args.port}" if args.port else "")
    coord = Coordinator(args.data, args.dead_after, args.expect_nodes, args.metadata, addr,
                        cluster_secret=cluster_secret, auth=args.auth,
                        super_users=[p for p in args.super_users.split(",") if p],
                        door=Door(door.from_args(args)), tls=tls_.from_args(ap, args))
    coord.repoint_evicted = args.repoint_evicted
    coord.chunk_rows_newest = args.chunk_rows_newest
    coord.retention_defaults = _retention({"retention_bytes": args.retention_bytes,
                                           "retention_ms": args.retention_ms})

    if args.metrics_port is not None:
        from ..metrics.coordinator import CoordinatorMetrics
        coord.metrics = CoordinatorMetrics(coord, args.metrics_lag_interval, args.metrics_top_groups)

    async def run():
        async with trio.open_nursery() as n:
            if coord.metrics is not None:
                await n.start(coord.metrics.run, args.metrics_host or args.host, args.metrics_port)
            port = await n.start(coord.run, args.host, args.port)
            print(f"coordinator listening on {args.host}:{port}", flush=True)

    from ..process import run_until_signal
    run_until_signal(run)
