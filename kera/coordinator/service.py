"""The coordinator: stream metadata, placement, recovery, and leadership.

``Coordinator`` is the coordinator's RPC face and its terms: each term (the one
term of a coordinator on its own data dir, or each election won in etcd) loads the
metadata and composes its parts, each handed what it needs of the others:

- ``metadata``: the store, the streams' catalog and the changes made through them
  (``kera.coordinator.metadata``), durable once ``commit`` returns;
- ``roster``: who is alive, at which epoch, who is declared dead (soft state,
  ``kera.coordinator.membership``);
- ``placement`` and ``admin``: where streamlets go, and the streams' RPCs
  (``kera.coordinator.placement``, ``kera.coordinator.streams``);
- ``recovery``, ``adoptions`` and ``recovered``: bringing a dead broker's streamlets
  back, adopting its closed history, and letting go of its files (``kera.recovery``,
  ``kera.coordinator.recovered``);
- ``accounts``: users and ACLs (``kera.security.accounts``).

With etcd, this process serves only while it leads; a standby answers ``not_leader``
naming the leader. Consumer-group positions are not metadata: they are records of an
internal stream (``kera.group_positions``) that this process only creates.
"""

from __future__ import annotations

import logging
import os

import trio

from .. import wire
from ..door import Door
from ..errors import NotLeader, Unavailable
from ..limits import CHUNK_ROWS_NEWEST
from ..recovery.adoption import Adoptions
from ..recovery.manager import RecoveryManager
from ..recovery.needs import Settings
from ..recovery.state import Recovery
from ..rpc import Pool
from ..security.accounts import Accounts
from ..security.credentials import Credentials
from ..security.gate import Gate
from ..security.mechanisms import COORDINATOR, MEMBER
from ..server import Service
from . import etcd
from .etcd_store import Election, EtcdMeta
from .membership import Roster
from .metadata import INITIAL, PACKED, Metadata
from .metalog import MetaLog
from .placement import Placement
from .recovered import Recovered
from .specs import RETENTION_DEFAULTS
from .streams import StreamAdmin

log = logging.getLogger("kera.coordinator")


class Coordinator(Service):
    """``metadata``: None for the embedded store (a ``MetaLog`` in ``data_dir``), or
    ``etcd://HOST:PORT[,...][/prefix]``: the state lives in etcd and this coordinator
    leads only while it holds the election there (``addr`` is what it advertises);
    otherwise it stands by, answering ``not_leader`` with the leader's address.
    ``repoint_evicted``, ``chunk_rows_newest``: how recoveries run (``kera.recovery``);
    ``retention_defaults``: new streams' retention unless their spec says."""

    rpcs = wire.COORDINATOR_RPCS

    def __init__(self, data_dir: str, dead_after: float = 2.0, expect_nodes: int = 0,
                 metadata: str | None = None, addr: str = "", *, cluster_secret: bytes,
                 auth: bool = False, super_users=(), door: Door | None = None, tls=(None, None),
                 repoint_evicted: bool = True, chunk_rows_newest: int = CHUNK_ROWS_NEWEST,
                 retention_defaults: dict | None = None):
        """``tls``: (the listener's context, the context to open TLS to members with)."""
        self.data_dir = data_dir
        self.cluster_secret = cluster_secret
        self.tls, self.member_tls = tls
        self.gate = Gate(cluster_secret, auth=auth, super_users=super_users)
        self.door = door or Door()
        self.dead_after = dead_after
        self.expect_nodes = expect_nodes  # a local cluster's size: not ready before it is complete
        self.retention_defaults = {**RETENTION_DEFAULTS, **(retention_defaults or {})}
        self.addr = addr
        self.pool: Pool | None = None
        self.leading = False
        self.terms = 0                    # times this process became the leader
        self.metrics = None               # kera.metrics.coordinator, with --metrics-port
        self.metadata_url = metadata or f"local:{os.path.abspath(data_dir)}"
        if metadata:
            endpoints, prefix = etcd.parse_url(metadata)
            self.etcd = etcd.Etcd(endpoints)
            self.election = Election(self.etcd, prefix, addr)
            self.store = lambda: EtcdMeta(self.etcd, prefix, self.election, INITIAL, packed=PACKED)
            rejoin_wait = 2 * dead_after   # after a takeover, brokers find the new leader
        else:
            os.makedirs(data_dir, exist_ok=True)
            self.etcd = self.election = None
            rejoin_wait = dead_after
        self.settings = Settings(grace=max(30.0, 10 * dead_after), rejoin_wait=rejoin_wait,
                                 repoint_evicted=repoint_evicted, chunk_rows_newest=chunk_rows_newest)
        if not metadata:
            self._begin_term(MetaLog(data_dir, INITIAL, legacy=os.path.join(data_dir, "coordinator.meta"),
                                     packed=PACKED))

    def _begin_term(self, store) -> None:
        """Lead with ``store``'s state: its parts composed afresh, membership empty (servers
        register again)."""
        pool = self._pool
        md = self.metadata = Metadata(store, self._committed)
        self.roster = Roster(md, pool, auth=self.gate.auth, dead_after=self.dead_after,
                             expect_nodes=self.expect_nodes)
        self.placement = Placement(self.roster, md, pool)
        self.admin = StreamAdmin(md, self.roster, self.placement, pool, self.retention_defaults)
        self.recovered = Recovered(md, self.roster)
        self.adoptions = Adoptions(self.roster, md, self.recovered, pool)
        self.recovery = RecoveryManager(self.roster, md, self.placement, self.adoptions,
                                        self.recovered, pool, self.settings, self._recovery_ended)
        self.accounts = Accounts(store, self.gate, md.commit, self.roster.addrs, pool)
        self.leading = True
        self.terms += 1

    # -- what the parts are handed -------------------------------------------------------
    def _pool(self) -> Pool:
        return self.pool

    def _committed(self, recovered: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.commit.observe(seconds)
        self.recovered.durable(recovered)

    def _recovery_ended(self, rec: Recovery, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.recovery_ended(rec, ok)

    # -- the door: a standby answers only pings and members' handshakes --------------------
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

    def _leader_hint(self) -> str:
        hint = self.election.leader if self.election is not None else ""
        return "" if hint == self.addr else hint

    def rpc_ping(self, meta, payload):
        return {"leading": self.leading}

    # -- members (kera.coordinator.membership) ----------------------------------------------
    async def rpc_register(self, meta, payload, peer):
        """A member joins: its id and epoch, and what it needs and lacks, as a heartbeat's
        answer says (users and ACLs, fences and recovered incarnations to a backup)."""
        m, out = await self.roster.register(meta)
        out.update({"fences": self.metadata.state["fences"], **self.accounts.heartbeat(None)})
        if m.role == "backup":
            out.update(self.recovered.answer(m, meta.get("recovered")))
        return out

    def rpc_heartbeat(self, meta, payload):
        """A member is alive; the answer carries what it needs and lacks: live backups (a
        broker), fences and recovered incarnations (a backup), users and ACLs (if it holds
        another version of them)."""
        m = self.roster.heartbeat(meta)
        security = self.accounts.heartbeat(meta.get("security"))
        if m.role == "backup":
            return {"fences": self.metadata.state["fences"], **self.recovered.answer(m, meta.get("recovered")),
                    **security}
        return {"backups": self.roster.tell_backups(m), **security}

    async def rpc_suspect(self, meta, payload):
        return await self.roster.suspect(meta)

    # -- users and ACLs (kera.security.accounts) ---------------------------------------------
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

    # -- streams (kera.coordinator.streams) --------------------------------------------------
    async def rpc_create_stream(self, meta, payload):
        return await self.admin.create_stream(meta)

    async def rpc_create_streams(self, meta, payload, peer):
        return await self.admin.create_streams(meta, peer)

    def rpc_list_streams(self, meta, payload, peer):
        return self.admin.list_streams(meta, peer)

    def rpc_metadata(self, meta, payload, peer):
        return self.admin.locate(meta, peer)

    def rpc_describe_stream(self, meta, payload):
        return {"stream": self.admin.describe(self.admin.stream(meta.get("name")))}

    async def rpc_delete_stream(self, meta, payload):
        return await self.admin.delete_stream(meta)

    async def rpc_alter_stream(self, meta, payload):
        return await self.admin.alter_stream(meta)

    async def rpc_positions_stream(self, meta, payload):
        return await self.admin.positions_stream()

    async def rpc_producer_id(self, meta, payload, peer):
        """A new producer id, never given before, and its token: bound to the caller's
        principal, so that no one else may write under it (``Peer.bind_producer``)."""
        pid = self.metadata.take("next_producer_id")
        await self.metadata.commit()
        return {"id": pid, "token": self.gate.producer_token(pid, peer.principal)}

    # -- status -----------------------------------------------------------------------------
    async def rpc_status(self, meta, payload):
        roster = self.roster
        if not roster.ready:
            raise Unavailable(f"cluster starting: {roster.complete_nodes()} of {self.expect_nodes} nodes up")

        def members(role):
            return [{**m.describe(), "stats": m.stats} for m in roster.members[role].values()]

        standbys = []
        if self.election is not None:
            with trio.move_on_after(2):
                standbys = await self.election.standbys()
        # streams by count only: their list is list_streams' job (it may be long)
        return {"brokers": members("broker"), "backups": members("backup"),
                "streams": len(self.metadata.streams), "recoveries": self.recovery.describe(),
                "recovered": self.recovered.describe(), "adoptions": self.adoptions.describe(),
                "coordinators": {"leader": self.addr, "standbys": standbys, "store": self.metadata_url,
                                 "terms": self.terms,
                                 **({"metrics": self.metrics.addr} if self.metrics else {})},
                **({"consumer_lag": self.metrics.lag.rows} if self.metrics else {})}

    # -- leading -----------------------------------------------------------------------------
    async def _lead(self, hold=None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """This term's tasks; with ``hold`` (etcd), until it returns: leadership lost."""
        async with trio.open_nursery() as n:
            await n.start(self.metadata.store.run)
            n.start_soon(self.roster.watch)
            n.start_soon(self.recovery.run)
            n.start_soon(self.adoptions.run)
            if not self.roster.ready and self.metadata.state["backups"]:
                n.start_soon(self._ready_after, self.settings.rejoin_wait)
            task_status.started()
            if hold is not None:
                await hold()
                n.cancel_scope.cancel()

    async def _ready_after(self, delay: float) -> None:
        """A cluster that existed before this term: its nodes had their time to rejoin."""
        await trio.sleep(delay)
        roster = self.roster
        if not roster.ready:
            log.info("%d of %d nodes rejoined; serving", roster.complete_nodes(), self.expect_nodes)
            roster.ready = True
            roster.notify()

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
                     len(self.metadata.streams))
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
            elif getattr(self, "metadata", None) is not None:
                self.metadata.store.close()
