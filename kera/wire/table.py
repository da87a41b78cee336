"""The wire table: every RPC of every server, its request fields and who may call it.

Servers admit a request from this table before its handler runs (``kera.rpc``): first
the caller (``Anyone``, any ``Authenticated`` peer, ``Members`` of given roles, maybe
only speaking for themselves, or a ``Client`` with an operation on a resource), then
every field (type and bounds; unknown fields refused), then the resource a client names.
A method missing from its server's table is refused as unknown, whatever the server
defines. Handlers do not check again what the table checks; what they still check is
what depends on their state (an epoch, an owner, a replica's chunk boundaries) or what
is refused per entry (a produce's chunks, a pull's streamlets: one entry's error, the
others served, as Kafka answers per partition).

Fields are named ``name`` (required) or ``name?`` (optional: absent or None). A value
too long for a list or too large for a count that a limit bounds is ``LimitExceeded``
naming the limit; any other misfit is ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from .. import limits
from ..errors import InvalidArgument, Unauthenticated, Unauthorized
from ..names import MAX_NAME
from ..security.acl import CLUSTER
from ..security.mechanisms import BACKUP, BROKER, CLIENT, COORDINATOR, SCRAM
from .fields import (
    ADDR,
    ANY,
    BOOL,
    INT,
    MAP,
    NAME,
    NUMBER,
    UINT,
    Bytes,
    ListOf,
    MapOf,
    Nullable,
    OneOf,
    Str,
    Struct,
    Tuple,
    UInt,
    field_specs,
)


# -- callers ---------------------------------------------------------------------------
class Caller:
    """Who may call: ``who`` checks the connection before the fields are read, ``what`` the
    resource the (checked) fields name."""

    def who(self, peer, rpc: str) -> None:
        pass

    def what(self, peer, meta: dict) -> None:
        pass


class Anyone(Caller):
    """Anyone, authenticated or not: the handshake itself."""

    def __str__(self) -> str:
        return "anyone"


class Authenticated(Caller):
    """Any authenticated peer (a member, a user, or an anonymous client when user
    authentication is off): harmless requests that name no resource."""

    def who(self, peer, rpc: str) -> None:
        if peer.role is None:
            raise Unauthenticated(f"{rpc}: authenticate first")

    def __str__(self) -> str:
        return "any authenticated peer"


class Members(Caller):
    """Cluster members of ``roles``; with ``as_self``, only naming itself in that field (a
    broker acts only as itself); with ``role_field``, naming its own role there."""

    def __init__(self, *roles: str, as_self: str = "", role_field: str = ""):
        self.roles, self.as_self, self.role_field = frozenset(roles), as_self, role_field

    def who(self, peer, rpc: str) -> None:
        if peer.role not in self.roles:
            if peer.role is None or peer.role == CLIENT:
                raise Unauthenticated(f"{rpc} is for cluster members ({', '.join(sorted(self.roles))}): "
                                      f"authenticate as one with the cluster secret")
            raise Unauthorized(f"{rpc} is for {', '.join(sorted(self.roles))}, not a {peer.role}")

    def what(self, peer, meta: dict) -> None:
        if self.role_field and meta.get(self.role_field) != peer.role:
            raise Unauthorized(f"a {peer.role} may not speak as a {meta.get(self.role_field)}")
        if self.as_self and (meta.get(self.as_self) or None) != peer.id:
            raise Unauthorized(f"{peer.role} {peer.id} may not speak for {self.as_self} "
                               f"{meta.get(self.as_self)}")

    def __str__(self) -> str:
        return "member: " + ", ".join(sorted(self.roles)) + (" (as itself)" if self.as_self else "")


class Client(Caller):
    """A client allowed ``op`` on a resource: the cluster, the stream or group a field
    names (``field``), or each entry's (``per_entry``: the handler asks ``peer.require``
    or ``peer.may`` per entry and refuses that entry alone). Members may do what clients
    do."""

    def __init__(self, op: str, resource: str = "cluster", field: str = "", per_entry: bool = False):
        self.op, self.resource, self.field, self.per_entry = op, resource, field, per_entry

    def who(self, peer, rpc: str) -> None:
        if peer.role is None:
            raise Unauthenticated(f"{rpc}: authenticate first")

    def what(self, peer, meta: dict) -> None:
        if self.resource == "cluster":
            peer.require(self.op, "cluster", CLUSTER)
        elif self.field and type(meta.get(self.field)) is str:   # else its handler refuses it
            peer.require(self.op, self.resource, meta[self.field])

    def __str__(self) -> str:
        on = "the cluster" if self.resource == "cluster" else f"each {self.resource}" \
            if self.per_entry else f"the {self.resource} named by {self.field}"
        return f"client: {self.op} on {on}"


ANYONE, AUTHENTICATED = Anyone(), Authenticated()


# -- the table -------------------------------------------------------------------------
class Rpc:
    """One RPC: its caller and request fields; ``peer``: the handler is given the caller's
    connection (``rpc_x(meta, payload, peer)``)."""

    __slots__ = ("name", "caller", "fields", "known", "peer")

    def __init__(self, caller: Caller, fields: dict | None = None, *, peer: bool = False):
        self.name = ""
        self.caller = caller
        self.fields = field_specs(fields or {})
        self.known = frozenset([n for n, _, _ in self.fields] + ["m"])
        self.peer = peer

    def admit(self, peer, meta: dict) -> None:
        """Refuse the request unless its caller may make it and every field fits."""
        name = self.name
        self.caller.who(peer, name)
        for field, spec, required in self.fields:
            v = meta.get(field)
            if v is None:
                if required:
                    raise InvalidArgument(f"{name} needs {field} ({spec.text})")
            elif not spec.ok(v):
                spec.check(v, f"{name}: {field}")
        if not meta.keys() <= self.known:
            extra = sorted(str(k) for k in meta.keys() - self.known)
            raise InvalidArgument(f"{name}: unknown field(s) {', '.join(extra)[:200]}")
        self.caller.what(peer, meta)


def named(table: dict[str, Rpc]) -> dict[str, Rpc]:
    """``table`` with each entry told its name."""
    for name, rpc in table.items():
        rpc.name = name
    return table


PAIR = Tuple(UINT, UINT)
VSEG = Tuple(UINT, UINT, UINT)   # [broker, vlog, vseg]
EPOCH = {"epoch": UINT}
REPLICA = {"broker": UINT, "vlog": UINT, "vseg": UINT}
ROLE = OneOf(BROKER, BACKUP)
MANY = 1 << 20   # entries of a list bounded only by the frame's meta (MAX_META)

# a stream spec's name and settings: their values are checked by the coordinator's stream
# rules (``kera.coordinator.specs.config``: names, shapes, limits), with the entry's index in a batch
STREAM_SETTINGS = {k: ANY for k in (
    "streamlets?", "groups?", "replication?", "segment_size?", "group_segments?", "vlogs?",
    "retention_bytes?", "retention_ms?", "retention.bytes?", "retention.ms?", "cleanup_policy?",
    "cleanup.policy?", "delete_retention_ms?", "delete.retention.ms?", "segment_ms?", "segment.ms?")}
ALTER_SETTINGS = {k: v for k, v in STREAM_SETTINGS.items() if k.startswith(("retention", "cleanup",
                                                                             "delete", "segment_ms",
                                                                             "segment.ms"))}
HANDSHAKE = {"mechanism?": Str(64, 1), "auth_bytes": Bytes(limits.MAX_AUTH_BYTES)}
USER = Str(255, 1)
ACL = Tuple(*[Str(255, 1)] * 6)   # principal, permission, operation, resource, name, pattern
SECURITY = {"version": UINT, "users": MapOf(USER, MAP, MANY), "acls": ListOf(ACL, MANY),
            "super_users": ListOf(Str(260, 1), MANY)}
PRODUCER = {"producer?": UINT, "token?": Bytes(64)}
STATS = Struct({"vlogs?": ListOf(Struct({"vlog": UINT, "durable": UINT}, extra=True), MANY)}, extra=True)

COMMON = {
    "authenticate": Rpc(ANYONE, HANDSHAKE, peer=True),
}

COORDINATOR_RPCS = named({
    **COMMON,
    "ping": Rpc(AUTHENTICATED),
    "register": Rpc(Members(BROKER, BACKUP, as_self="id", role_field="role"), {
        "role": ROLE, "addr": ADDR, "node?": Str(MAX_NAME), "id?": UINT, "epoch?": UINT,
        "holds?": ListOf(Tuple(UINT, UINT, UINT, UINT, BOOL), MANY), "recovered?": UINT,
        "auth?": BOOL, "kafka?": ADDR}, peer=True),   # kafka: a broker's Kafka listener
    "heartbeat": Rpc(Members(BROKER, BACKUP, as_self="id", role_field="role"), {
        "role": ROLE, "id": UINT, "epoch": UINT, "stats?": STATS, "recovered?": UINT,
        "damage?": UINT, "security?": INT}),
    "user_add": Rpc(Client("alter"), {"name": USER, "credentials": MapOf(
        OneOf(*SCRAM), ListOf(ANY, 4, 4), 2)}),
    "user_delete": Rpc(Client("alter"), {"name": USER}),
    "user_list": Rpc(Client("describe")),
    "acl_add": Rpc(Client("alter"), {"acl": ACL}),
    "acl_remove": Rpc(Client("alter"), {"acl": ACL}),
    "acl_list": Rpc(Client("describe"), {"principal?": Str(260, 1)}),
    "suspect": Rpc(AUTHENTICATED, {"addr": ADDR}),
    "create_stream": Rpc(Client("create", "stream", "name"), {"name?": ANY, **STREAM_SETTINGS}),
    "create_streams": Rpc(Client("create", "stream", per_entry=True), {
        "streams": ListOf(MAP, limits.MAX_BATCH_STREAMS, 1, "MAX_BATCH_STREAMS")}, peer=True),
    "list_streams": Rpc(Client("describe", "stream", per_entry=True), {
        "pattern?": Str(1024), "after?": Str(MAX_NAME),
        "limit?": UInt(limits.MAX_LIST_PAGE, "MAX_LIST_PAGE", low=1)}, peer=True),
    "describe_stream": Rpc(Client("describe", "stream", "name"), {"name": NAME}),
    "metadata": Rpc(Client("describe", "stream", per_entry=True), {
        "names?": ListOf(NAME, limits.MAX_LIST_PAGE, limit="MAX_LIST_PAGE"), "pattern?": Str(1024),
        "after?": Str(MAX_NAME), "since?": UINT, "columns?": BOOL,
        "limit?": UInt(limits.MAX_LIST_PAGE, "MAX_LIST_PAGE", low=1)}, peer=True),
    "delete_stream": Rpc(Client("delete", "stream", "name"), {"name": NAME}),
    "alter_stream": Rpc(Client("alter-configs", "stream", "name"), {"name": NAME, **ALTER_SETTINGS}),
    "producer_id": Rpc(AUTHENTICATED, peer=True),
    "positions_stream": Rpc(AUTHENTICATED),
    "status": Rpc(Client("describe")),
})

BROKER_RPCS = named({
    **COMMON,
    "ping": Rpc(AUTHENTICATED),
    "assign": Rpc(Members(COORDINATOR), {
        **EPOCH, "stream?": MAP, "streamlets?": ListOf(UINT, limits.MAX_STREAMLETS),
        "streams?": ListOf(Tuple(MAP, ListOf(UINT, limits.MAX_STREAMLETS)), limits.MAX_BATCH_STREAMS),
        "ids?": ListOf(Tuple(UINT, ListOf(UINT, limits.MAX_STREAMLETS)), limits.MAX_BATCH_STREAMS),
        "recovering?": BOOL, "seal?": BOOL,
        "backups?": ListOf(Struct({"id": UINT, "addr": ADDR, "node": Str(MAX_NAME), "epoch": UINT},
                                  extra=True), MANY)}),
    "configure": Rpc(Members(COORDINATOR), {**EPOCH, "stream": MAP}),
    "unassign": Rpc(Members(COORDINATOR), {
        **EPOCH, "stream_id?": UINT, "streamlets?": ListOf(UINT, limits.MAX_STREAMLETS),
        "streams?": ListOf(Tuple(UINT, Nullable(ListOf(UINT, limits.MAX_STREAMLETS))),
                           limits.MAX_BATCH_STREAMS)}),
    "produce": Rpc(Client("write", "stream", per_entry=True), {
        **PRODUCER, "acks?": OneOf("all", "leader", "none"), "positions?": BOOL,
        "positions_of?": Bytes(limits.MAX_PRODUCE_PAYLOAD)}, peer=True),
    "append_if": Rpc(Client("write", "stream", per_entry=True), {**PRODUCER, "expect?": ANY},
                     peer=True),
    "tail": Rpc(Client("read", "stream", per_entry=True), {"stream_id": UINT, "streamlet": UINT},
                peer=True),
    "pull": Rpc(Client("read", "stream", per_entry=True), {   # streamlets, or a session's changes
        "streamlets?": ListOf(ANY, limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS"),
        "session?": UINT, "add?": ListOf(ANY, limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS"),
        "drop?": ListOf(PAIR, limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS"),
        "starts?": Bytes(16 * limits.MAX_PULL_STREAMLETS), "epoch?": UINT, "columns?": BOOL,
        "max_bytes?": INT, "max_wait_ms?": NUMBER}, peer=True),
    "offsets": Rpc(Client("describe", "stream", per_entry=True), {
        "streamlets?": ListOf(PAIR, limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS")},
        peer=True),
    "seek": Rpc(Client("describe", "stream", per_entry=True), {
        "seeks?": ListOf(Tuple(UINT, UINT, UINT, UINT), limits.MAX_PULL_STREAMLETS,
                         limit="MAX_PULL_STREAMLETS")}, peer=True),
    "lag": Rpc(Members(COORDINATOR), {   # a consumer group's lag, for the coordinator's metrics
        "positions": ListOf(ANY, limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS")}),
    "vsegs": Rpc(Client("describe")),
    "stats": Rpc(Client("describe"), {"streams?": BOOL}),
    "recover": Rpc(Members(BACKUP), EPOCH),
    "adopt": Rpc(Members(COORDINATOR), EPOCH),
    "pend": Rpc(Members(COORDINATOR), {
        **EPOCH, "source": PAIR,
        "entries": ListOf(Tuple(UINT, UINT, ListOf(PAIR, MANY), ListOf(PAIR, MANY),
                                ListOf(PAIR, limits.MAX_GROUPS), UINT, least=5), MANY)}),
    "settle": Rpc(Members(COORDINATOR), EPOCH),
    "security": Rpc(Members(COORDINATOR), SECURITY),
    # Kafka offsets <-> positions of streamlets held here, for a group's coordinator (kera.kafka.offsets)
    "kafka_map": Rpc(Members(BROKER), {
        "offsets?": ListOf(Tuple(UINT, UINT, INT), limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS"),
        "positions?": ListOf(ANY, limits.MAX_PULL_STREAMLETS, limit="MAX_PULL_STREAMLETS")}),
})

BACKUP_RPCS = named({
    **COMMON,
    "replicate": Rpc(Members(BROKER, as_self="broker"), {
        "broker": UINT, "epoch?": UINT, "vlog?": UINT, "vseg?": UINT, "offset?": UINT,
        "close?": BOOL, "entries?": ListOf(Tuple(UINT, UINT, UINT, BOOL, UINT),
                                           limits.REPLICATE_ENTRIES, 1, "REPLICATE_ENTRIES")}),
    "list": Rpc(Members(COORDINATOR, BROKER), {"broker?": UINT, "columns?": BOOL}),
    "fence": Rpc(Members(COORDINATOR), {"broker": UINT, "epoch": UINT}),
    "stats": Rpc(Client("describe")),
    "read_chunks": Rpc(Members(BROKER), {**REPLICA, "ranges": ListOf(PAIR, MANY, 1)}),
    "index": Rpc(Members(COORDINATOR), {
        "broker": UINT, "vsegs": ListOf(Tuple(UINT, UINT, BOOL, BOOL, least=2), limits.INDEX_VSEGS, 1)}),
    "read": Rpc(Members(COORDINATOR, BROKER), {**REPLICA, "offset?": UINT, "max_bytes?": UINT}),
    "replay": Rpc(Members(COORDINATOR), {
        **REPLICA, "offset?": UINT, "owners": ListOf(Tuple(ADDR, UINT), MANY),   # routes: payload
        "replay_from?": ListOf(Tuple(UINT, UINT, UINT, UINT), MANY)}),
    "trim": Rpc(Members(BROKER, as_self="broker"), {"broker": UINT, "vlog": UINT, "floor": UINT}),
    "claim": Rpc(Members(BROKER, as_self="owner"), {"owner": UINT, "epoch": UINT,
                                                     "claims": ListOf(VSEG, MANY)}),
    "release": Rpc(Members(BROKER, as_self="owner"), {"owner": UINT, "epoch": UINT,
                                                       "claims?": ListOf(VSEG, MANY)}),
    "security": Rpc(Members(COORDINATOR), SECURITY),
})

TABLES = {COORDINATOR: COORDINATOR_RPCS, BROKER: BROKER_RPCS, BACKUP: BACKUP_RPCS}
