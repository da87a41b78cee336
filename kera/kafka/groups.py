"""Consumer groups, Kafka's classic protocol: FindCoordinator, JoinGroup, SyncGroup,
Heartbeat, LeaveGroup, DescribeGroups, ListGroups (OffsetCommit and OffsetFetch: ``offsets``).

A group's coordinator is the broker owning the streamlet of kera's positions stream that
the group's commits go to (``kera.group_positions.streamlet_of``), so a group's
membership and its committed positions live on one broker; when that streamlet moves
(a recovery) the clients are told ``NOT_COORDINATOR``, find the new one and join again.
Membership is soft state, as in Kafka: members join (the first round of an empty group
waits ``INITIAL_DELAY`` for others), the leader's assignment is handed out by SyncGroup,
heartbeats keep a member, a member silent for its session timeout is removed and the
group rebalances. A generation lives only in memory: a new coordinator starts at the
next generation the members join.
"""

from __future__ import annotations

import time
import uuid

import trio
from kio.schema.errors import ErrorCode

from .. import group_positions
from ..errors import KeraError
from . import offsets

INITIAL_DELAY = 0.3       # s an empty group's first rebalance waits for more members
EXPIRY_EVERY = 0.5        # s between looks for members past their session timeout
POSITIONS_TTL = 1.0       # s the positions stream's placement is trusted


class Member:
    __slots__ = ("id", "client_id", "host", "session", "rebalance", "protocols", "assignment",
                 "seen", "joined")

    def __init__(self, mid: str, client_id: str, host: str):
        self.id, self.client_id, self.host = mid, client_id, host
        self.session = self.rebalance = 10.0
        self.protocols: list = []
        self.assignment = b""
        self.seen = time.monotonic()
        self.joined = False


class Group:
    __slots__ = ("name", "state", "generation", "protocol_type", "protocol", "leader", "members",
                 "changed", "joins", "synced", "result")

    def __init__(self, name: str):
        self.name = name
        self.state = "Empty"
        self.generation = 0
        self.protocol_type = ""
        self.protocol: str | None = None
        self.leader = ""
        self.members: dict[str, Member] = {}
        self.changed = trio.Event()   # a member joined or left during a rebalance
        self.joins = trio.Event()     # the current join round completed
        self.synced = trio.Event()    # the leader's assignment of this generation arrived
        self.result: dict = {}

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class Coordinator:
    def __init__(self, gw):
        self.gw = gw
        self.groups: dict[str, Group] = {}
        self.nursery: trio.Nursery | None = None
        self._positions: tuple[float, dict, dict] | None = None
        self.offsets = offsets.Offsets(gw, self)

    async def refused(self, conn, group: str) -> ErrorCode | None:
        """The error code refusing a request about ``group`` here, or None (OffsetCommit and
        OffsetFetch ask it too)."""
        if not conn.peer.may("read", "group", group):
            return ErrorCode.group_authorization_failed
        if not await self.mine(group):
            return ErrorCode.not_coordinator
        return None

    @staticmethod
    def stale(g: Group | None, mid: str, generation: int) -> ErrorCode | None:
        """The error code refusing member ``mid`` of generation ``generation`` of ``g``, or
        None (and the member is seen now)."""
        if g is None or mid not in g.members:
            return ErrorCode.unknown_member_id
        if generation != g.generation:
            return ErrorCode.illegal_generation
        g.members[mid].seen = time.monotonic()
        return None

    async def run(self) -> None:
        async with trio.open_nursery() as n:
            self.nursery = n
            while True:
                await trio.sleep(EXPIRY_EVERY)
                self._expire()

    # -- where groups live -------------------------------------------------------------
    async def positions(self) -> tuple[dict, dict]:
        """The positions stream's map and the brokers' Kafka addresses (cached briefly)."""
        now = time.monotonic()
        if self._positions is None or now - self._positions[0] > POSITIONS_TTL:
            await self.gw.coordinator("positions_stream", {})
            r = await self.gw.coordinator("metadata", {"names": [group_positions.NAME]})
            self._positions = (now, r["streams"][0], r.get("kafka") or {})
        return self._positions[1], self._positions[2]

    def streamlet(self, group: str):
        """The positions streamlet of ``group`` if this broker owns it (and serves it)."""
        if self._positions is None:
            return None
        s = self._positions[1]
        sl = self.gw.broker.streamlets.get((s["id"], group_positions.streamlet_of(group,
                                                                                   s["streamlets"])))
        return sl if sl is not None and not sl.recovering else None

    async def mine(self, group: str) -> bool:
        try:
            await self.positions()
        except KeraError:
            return False
        return self.streamlet(group) is not None

    # -- membership ------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        for g in list(self.groups.values()):
            gone = [m for m in g.members.values() if now - m.seen > m.session]
            for m in gone:
                self._remove(g, m.id)

    def _remove(self, g: Group, mid: str) -> None:
        g.members.pop(mid, None)
        if not g.members:
            g.state, g.leader = "Empty", ""
            g.poke()
        elif g.state in ("Stable", "CompletingRebalance"):
            self._rebalance(g)
        else:
            g.poke()

    def _rebalance(self, g: Group, delay: float = 0.0) -> None:
        g.state = "PreparingRebalance"
        for m in g.members.values():
            m.joined = False
        g.joins = trio.Event()
        g.synced.set()            # anyone waiting on the old generation's sync gives up
        self.nursery.start_soon(self._complete_join, g, g.joins, delay)

    async def _complete_join(self, g: Group, round_: trio.Event, delay: float) -> None:
        """Once every member joined again (or their rebalance timeout passed): the next
        generation, its protocol and leader."""
        timeout = max((m.rebalance for m in g.members.values()), default=1.0)
        await trio.sleep(delay)
        with trio.move_on_after(timeout):
            while not all(m.joined for m in g.members.values()):
                await g.changed.wait()
        for mid in [m.id for m in g.members.values() if not m.joined]:
            g.members.pop(mid)
        if g.joins is not round_:
            return
        if not g.members:
            g.state, g.leader = "Empty", ""
            round_.set()
            return
        g.generation += 1
        members = list(g.members.values())
        if g.leader not in g.members:
            g.leader = members[0].id
        common = set.intersection(*({n for n, _ in m.protocols} for m in members))
        g.protocol = next((n for n, _ in g.members[g.leader].protocols if n in common), None)
        g.state = "CompletingRebalance"
        g.synced = trio.Event()
        g.result = {m.id: dict(m.protocols).get(g.protocol, b"") for m in members}
        round_.set()

    def group(self, name: str) -> Group:
        g = self.groups.get(name)
        if g is None:
            g = self.groups[name] = Group(name)
        return g


def handlers(gw) -> dict:
    c = gw.groups
    return {"find_coordinator": lambda conn, r, v: _find(gw, conn, r, v),
            "join_group": lambda conn, r, v: _join(c, conn, r, v),
            "sync_group": lambda conn, r, v: _sync(c, conn, r, v),
            "heartbeat": lambda conn, r, v: _heartbeat(c, conn, r, v),
            "leave_group": lambda conn, r, v: _leave(c, conn, r, v),
            "describe_groups": lambda conn, r, v: _describe(c, conn, r, v),
            "list_groups": lambda conn, r, v: _list(c, conn, r, v),
            "offset_commit": lambda conn, r, v: c.offsets.commit(conn, r, v),
            "offset_fetch": lambda conn, r, v: c.offsets.fetch(conn, r, v)}


async def _find(gw, conn, req, version):
    out = {"throttle_time": 0, "node_id": -1, "host": "", "port": -1}
    key_type = getattr(req, "key_type", 0)
    if key_type != 0:
        return {**out, "error_code": ErrorCode.coordinator_not_available,
                "error_message": "transactions are not served"}
    if not conn.peer.may("describe", "group", req.key) and not conn.peer.may("read", "group", req.key):
        return {**out, "error_code": ErrorCode.group_authorization_failed}
    try:
        s, kafka = await gw.groups.positions()
    except KeraError:
        return {**out, "error_code": ErrorCode.coordinator_not_available}
    i = group_positions.streamlet_of(req.key, s["streamlets"])
    owner = s["owners"][i][0]
    addr = kafka.get(owner) if s["addrs"][i] is not None else None
    if addr is None:
        return {**out, "error_code": ErrorCode.coordinator_not_available}
    host, _, port = addr.rpartition(":")
    return {**out, "error_code": ErrorCode.none, "node_id": owner, "host": host, "port": int(port)}


async def _join(c: Coordinator, conn, req, version):
    out = {"throttle_time": 0, "generation_id": -1, "protocol_type": None, "protocol_name": None,
           "leader": "", "member_id": req.member_id, "members": ()}
    err = await c.refused(conn, req.group_id)
    if err is not None:
        return {**out, "error_code": err}
    g = c.group(req.group_id)
    if g.members and req.protocol_type != g.protocol_type:
        return {**out, "error_code": ErrorCode.inconsistent_group_protocol}
    mid = req.member_id
    if not mid:
        mid = f"{conn.client_id or 'member'}-{uuid.uuid4()}"
    elif mid not in g.members:
        return {**out, "error_code": ErrorCode.unknown_member_id}
    m = g.members.get(mid) or Member(mid, conn.client_id or "", conn.addr)
    g.members[mid] = m
    g.protocol_type = req.protocol_type
    m.session = req.session_timeout.total_seconds()
    m.rebalance = getattr(req, "rebalance_timeout", req.session_timeout).total_seconds()
    m.protocols = [(p.name, p.metadata) for p in req.protocols]
    m.seen = time.monotonic()
    if g.state != "PreparingRebalance":
        c._rebalance(g, INITIAL_DELAY if g.state == "Empty" else 0.0)
    m.joined = True
    g.poke()
    round_ = g.joins
    await round_.wait()
    if mid not in g.members:
        return {**out, "member_id": mid, "error_code": ErrorCode.unknown_member_id}
    members = [{"member_id": k, "metadata": v} for k, v in g.result.items()] if mid == g.leader else []
    return {**out, "error_code": ErrorCode.none, "generation_id": g.generation,
            "protocol_type": g.protocol_type, "protocol_name": g.protocol, "leader": g.leader,
            "member_id": mid, "members": members}


async def _sync(c: Coordinator, conn, req, version):
    out = {"throttle_time": 0, "protocol_type": None, "protocol_name": None, "assignment": b""}
    err = await c.refused(conn, req.group_id)
    g = c.groups.get(req.group_id)
    err = err or c.stale(g, req.member_id, req.generation_id)
    if err is None and g.state == "PreparingRebalance":
        err = ErrorCode.rebalance_in_progress
    if err is not None:
        return {**out, "error_code": err}
    if req.member_id == g.leader and g.state == "CompletingRebalance":
        given = {a.member_id: a.assignment for a in req.assignments}
        for m in g.members.values():
            m.assignment = given.get(m.id, b"")
        g.state = "Stable"
        g.synced.set()
    synced = g.synced
    with trio.move_on_after(g.members[req.member_id].session):
        await synced.wait()
    m = g.members.get(req.member_id)
    if m is None or g.state != "Stable":
        return {**out, "error_code": ErrorCode.rebalance_in_progress}
    return {**out, "error_code": ErrorCode.none, "protocol_type": g.protocol_type,
            "protocol_name": g.protocol, "assignment": m.assignment}


async def _heartbeat(c: Coordinator, conn, req, version):
    err = await c.refused(conn, req.group_id)
    g = c.groups.get(req.group_id)
    err = err or c.stale(g, req.member_id, req.generation_id)
    if err is None and g.state == "PreparingRebalance":
        err = ErrorCode.rebalance_in_progress
    return {"throttle_time": 0, "error_code": err or ErrorCode.none}


async def _leave(c: Coordinator, conn, req, version):
    err = await c.refused(conn, req.group_id)
    ids = [m.member_id for m in req.members] if hasattr(req, "members") else [req.member_id]
    g = c.groups.get(req.group_id)
    out = []
    for mid in ids:
        code = err or (ErrorCode.unknown_member_id if g is None or mid not in g.members else ErrorCode.none)
        if code == ErrorCode.none:
            c._remove(g, mid)
        out.append({"member_id": mid, "error_code": code})
    return {"throttle_time": 0, "error_code": err or ErrorCode.none, "members": out}


async def _describe(c: Coordinator, conn, req, version):
    out = []
    for name in req.groups:
        err = await c.refused(conn, name)
        g = c.groups.get(name)
        d = {"error_code": err or ErrorCode.none, "group_id": name, "group_state": "Dead",
             "protocol_type": "", "protocol_data": "", "members": (), "authorized_operations": -1}
        if err is None and g is not None:
            d.update(group_state=g.state, protocol_type=g.protocol_type, protocol_data=g.protocol or "",
                     members=[{"member_id": m.id, "client_id": m.client_id, "client_host": m.host,
                               "member_metadata": dict(m.protocols).get(g.protocol, b""),
                               "member_assignment": m.assignment} for m in g.members.values()])
        elif err is None:
            d["group_state"] = "Empty"
        out.append(d)
    return {"throttle_time": 0, "groups": out}


async def _list(c: Coordinator, conn, req, version):
    states = set(getattr(req, "states_filter", ()) or ())
    await c.positions()
    groups = [{"group_id": g.name, "protocol_type": g.protocol_type, "group_state": g.state}
              for g in c.groups.values() if c.streamlet(g.name) is not None
              and conn.peer.may("describe", "group", g.name) and (not states or g.state in states)]
    return {"throttle_time": 0, "error_code": ErrorCode.none, "groups": groups}
