"""The wire table (``kera.wire``): every RPC of every server is in it and nothing else, and
a request is admitted from it (caller first, then fields) before any handler runs."""

from __future__ import annotations

import inspect

import pytest

from kera import limits, wire
from kera.backup.service import BackupService
from kera.broker.service import BrokerService
from kera.coordinator.service import Coordinator
from kera.errors import InvalidArgument, LimitExceeded, Unauthenticated, Unauthorized
from kera.security.gate import Gate
from kera.security.mechanisms import Identity, member_principal

SERVERS = {"coordinator": Coordinator, "broker": BrokerService, "backup": BackupService}


@pytest.mark.parametrize("role", sorted(SERVERS))
def test_every_handler_is_in_the_table_and_every_entry_has_a_handler(role):
    """Both ways: a server's ``rpc_*`` handlers are its table's entries, no more (a handler
    the table lacks is never reached: refused as unknown) and no fewer (an entry without a
    handler would admit a request nothing serves); each handler takes the caller's
    connection exactly when its entry says it is given it (``Rpc.peer``)."""
    cls = SERVERS[role]
    handlers = {n[4:] for n in dir(cls) if n.startswith("rpc_") and callable(getattr(cls, n))}
    table = wire.TABLES[role]
    assert not handlers - set(table), f"handlers not in the table: {sorted(handlers - set(table))}"
    assert not set(table) - handlers, f"table entries without a handler: {sorted(set(table) - handlers)}"
    assert cls.rpcs is table
    for name, rpc in table.items():
        assert rpc.name == name and isinstance(rpc.caller, wire.Caller)
        params = list(inspect.signature(getattr(cls, f"rpc_{name}")).parameters)[1:]
        assert len(params) == (3 if rpc.peer else 2), (name, params, rpc.peer)


def _peer(role=None, mid=None, auth=False):
    p = Gate(b"s" * 32, auth=auth).peer("127.0.0.1")
    if role is not None:
        p.authenticated(Identity(role, mid, member_principal(role, mid)))
    return p


def test_members_only_and_only_as_themselves():
    trim = wire.BACKUP_RPCS["trim"]
    meta = {"m": "trim", "broker": 2, "vlog": 0, "floor": 1}
    with pytest.raises(Unauthenticated):          # an anonymous client (user auth off)
        trim.admit(_peer(), meta)
    with pytest.raises(Unauthenticated):          # nobody yet (user auth on)
        trim.admit(_peer(auth=True), meta)
    with pytest.raises(Unauthorized):             # a backup is not a broker
        trim.admit(_peer("backup", 2), meta)
    with pytest.raises(Unauthorized):             # broker 3 does not speak for broker 2
        trim.admit(_peer("broker", 3), meta)
    trim.admit(_peer("broker", 2), meta)
    hb = wire.COORDINATOR_RPCS["heartbeat"]
    with pytest.raises(Unauthorized):             # as a broker, from a backup's connection
        hb.admit(_peer("backup", 2), {"role": "broker", "id": 2, "epoch": 1})
    with pytest.raises(Unauthorized):
        hb.admit(_peer("broker", 2), {"role": "broker", "id": 3, "epoch": 1})
    hb.admit(_peer("broker", 2), {"role": "broker", "id": 2, "epoch": 1})
    reg = wire.COORDINATOR_RPCS["register"]   # a member with no id yet asks for none
    reg.admit(_peer("backup", None), {"role": "backup", "addr": "127.0.0.1:9"})
    with pytest.raises(Unauthorized):
        reg.admit(_peer("backup", None), {"role": "backup", "addr": "127.0.0.1:9", "id": 4})


def test_fields_are_checked_typed_and_bounded_before_the_handler():
    rep = wire.BACKUP_RPCS["replicate"]
    me = _peer("broker", 1)
    ok = {"broker": 1, "epoch": 1, "entries": [[0, 0, 0, False, 10]]}
    rep.admit(me, ok)
    for bad in ({**ok, "entries": [[0, 0, 0, 0, 10]]}, {**ok, "entries": [[0, -1, 0, False, 10]]},
                {**ok, "entries": []}, {**ok, "epoch": "1"}, {**ok, "surprise": 1},
                {"epoch": 1, "entries": ok["entries"]}):
        with pytest.raises((InvalidArgument, Unauthorized)):
            rep.admit(me, bad)
    with pytest.raises(LimitExceeded) as e:
        rep.admit(me, {**ok, "entries": [[0, 0, 0, False, 0]] * (limits.REPLICATE_ENTRIES + 1)})
    assert e.value.limit == "REPLICATE_ENTRIES"
    with pytest.raises(InvalidArgument, match="unknown field"):
        wire.BROKER_RPCS["stats"].admit(_peer(), {"streams": True, "extra": 1})
    with pytest.raises(LimitExceeded):
        wire.COORDINATOR_RPCS["list_streams"].admit(_peer(), {"limit": limits.MAX_LIST_PAGE + 1})


@pytest.mark.parametrize("addr,ok", [
    ("127.0.0.1:7700", True), ("node-1.example.org:1", True), ("[::1]:80", True),
    ("x", False), ("127.0.0.1:0", False), ("127.0.0.1:70000", False), (":80", False),
    ("a b:80", False), ("host:8o", False), (7, False), ("h" * 300 + ":1", False)])
def test_addresses_are_validated_at_the_door(addr, ok):
    assert wire.ADDR.ok(addr) is ok


def test_clients_need_their_operation_on_the_resource():
    from kera.security.acl import Acl
    g = Gate(b"s" * 32, auth=True)
    g.replace(1, {}, [Acl("User:alice", "allow", "describe", "stream", "s")])
    alice = g.peer("127.0.0.1")
    alice.authenticated(Identity("client", None, "User:alice"))
    wire.COORDINATOR_RPCS["describe_stream"].admit(alice, {"name": "s"})
    with pytest.raises(Unauthorized):
        wire.COORDINATOR_RPCS["describe_stream"].admit(alice, {"name": "t"})
    with pytest.raises(Unauthorized):
        wire.COORDINATOR_RPCS["delete_stream"].admit(alice, {"name": "s"})
    with pytest.raises(Unauthenticated):     # nobody: only the handshake
        wire.COORDINATOR_RPCS["describe_stream"].admit(g.peer("127.0.0.1"), {"name": "s"})
    wire.COORDINATOR_RPCS["authenticate"].admit(g.peer("127.0.0.1"), {
        "mechanism": "SCRAM-SHA-256", "auth_bytes": b"n,,n=alice,r=x"})


def test_a_connections_acl_decisions_stay_bounded():
    """A user listing a million streams asks one decision per stream: the connection keeps at
    most ``ACL_CACHE`` of them, and still answers each rightly."""
    from kera.limits import ACL_CACHE
    from kera.security.acl import Acl
    g = Gate(b"s" * 32, auth=True)
    g.replace(1, {}, [Acl("User:alice", "allow", "describe", "stream", "a-", "prefixed")])
    alice = g.peer("127.0.0.1")
    alice.authenticated(Identity("client", None, "User:alice"))
    got = [alice.may("describe", "stream", f"{p}-{i}") for i in range(3 * ACL_CACHE) for p in "ab"]
    assert got == [True, False] * (3 * ACL_CACHE)
    assert len(alice.cache) <= ACL_CACHE
