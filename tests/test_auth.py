"""A cluster run with ``--auth``: users (SCRAM), ACLs, and nothing for anyone else.

One cluster serves the module (``kera up --auth``'s way: an ``admin`` super user and its
``client.conf``); names are unique per test. Through the Python client, the CLI,
consumer groups and the key-value map: no credentials get only a handshake, a user with
no ACL can do nothing, literal and prefixed allows work, deny wins, the super user can do
all, a wrong password and an unknown mechanism are typed errors. (The Spark source and
sink: ``tests/test_spark.py``.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio
from kera_client import open_admin, open_consumer, open_kv, open_producer

from kera import chunk
from kera.cluster import LocalCluster
from kera.errors import (
    AuthenticationFailed,
    KeraError,
    Unauthorized,
    UnsupportedMechanism,
)
from kera.rpc import Pool, open_pool
from kera.security import client_config
from kera.security.acl import Acl
from kera.security.credentials import Credentials

from .workload import read_values

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(str(tmp_path_factory.mktemp("auth")), 2, auth=True)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def settings(c, user: str | None = None, password: str | None = None, **more) -> dict:
    s = client_config.read(c.client_conf)   # admin's
    if user is not None:
        s.update({"sasl.username": user, "sasl.password": password})
    return {**s, **more}


async def add_user(c, name: str, *acls: Acl) -> dict:
    async with open_admin(c.coordinator, settings(c)) as a:
        await a.add_user(name, f"pw-{name}")
        for acl in acls:
            await a.add_acl(acl)
    return settings(c, name, f"pw-{name}")


def allow(user, op, resource, name, pattern="literal", permission="allow") -> Acl:
    return Acl(f"User:{user}", permission, op, resource, name, pattern)


async def code_of(coro) -> str:
    try:
        await coro
    except KeraError as e:
        return e.code
    return "ok"


async def test_no_credentials_get_only_a_handshake(cluster):
    async with open_admin(cluster.coordinator, settings(cluster)) as a:
        st = await a.status()
    broker, backup = st["brokers"][0]["addr"], st["backups"][0]["addr"]
    async with open_pool() as nobody:
        for addr, method, meta in ((cluster.coordinator, "list_streams", {}),
                                   (cluster.coordinator, "producer_id", {}),
                                   (cluster.coordinator, "ping", {}), (broker, "stats", {}),
                                   (broker, "produce", {}), (backup, "stats", {}),
                                   (backup, "trim", {"broker": 1, "vlog": 0, "floor": 1})):
            assert await code_of(nobody.call(addr, method, meta, timeout=5)) == "unauthenticated", method
        for mech in ("GSSAPI", "PLAIN"):   # unknown here; PLAIN only over TLS
            with pytest.raises(UnsupportedMechanism) as e:
                await nobody.call(broker, "authenticate", {"mechanism": mech, "auth_bytes": b"x"}, timeout=5)
            assert "SCRAM-SHA-256" in e.value.mechanisms
    for bad in ({"sasl.password": "wrong"}, {"sasl.username": "nobody"}):
        with pytest.raises(AuthenticationFailed):
            async with open_admin(cluster.coordinator, settings(cluster, **bad)) as a:
                await a.list_streams()
    with pytest.raises(UnsupportedMechanism):
        async with open_admin(cluster.coordinator, settings(cluster, **{"sasl.mechanism": "PLAIN"})) as a:
            await a.list_streams()
    async with trio.open_nursery() as n:   # a member's proof with another secret
        pool = Pool(n, credentials=Credentials.member(os.urandom(32), "broker", 1))
        with pytest.raises(AuthenticationFailed):
            await pool.call(broker, "stats", {}, timeout=5)
        n.cancel_scope.cancel()
    async with open_admin(cluster.coordinator, settings(cluster, **{"sasl.mechanism": "SCRAM-SHA-512"})) as a:
        assert (await a.status())["brokers"]


async def test_a_user_without_acls_can_do_nothing_and_the_super_user_all(cluster):
    coord = cluster.coordinator
    async with open_admin(coord, settings(cluster)) as a:   # admin: a super user
        await a.create_stream("n-data", replication=2)
        await a.alter_stream("n-data", retention_ms=86_400_000)
    nacl = await add_user(cluster, "nacl")
    async with open_admin(coord, nacl) as a:
        for what in (a.create_stream("n-new"), a.describe_stream("n-data"), a.delete_stream("n-data"),
                     a.alter_stream("n-data", retention_ms=1), a.status(), a.users(),
                     a.add_acl(allow("nacl", "all", "cluster", "kera-cluster")),
                     a.add_user("x", "y")):
            assert await code_of(what) == "unauthorized"
        assert await a.list_streams() == []          # it sees nothing
    async with open_producer(coord, nacl) as p:   # the record's report says why (as Kafka's)
        report = await p.send("n-data", b"x", report=True)
        with pytest.raises(Unauthorized):
            await report
    with pytest.raises(Unauthorized):
        async with open_consumer(["n-data"], coord, nacl) as c:
            await c.poll_chunks(1)
    # a producer id of its own, and a chunk sent by hand: refused for that chunk
    async with open_admin(coord, nacl) as a:
        mine = await a.call("producer_id")
    async with open_admin(coord, settings(cluster)) as a:
        s = await a.describe_stream("n-data")
    async with open_pool(credentials=client_config.credentials(nacl)) as pool:
        r, _ = await pool.call(s.addrs[0], "produce", {"producer": mine["id"], "token": mine["token"]},
                               chunk.build(s.id, 0, mine["id"], 0, [b"x"]), timeout=5)
        assert r["errors"] == [[0, "unauthorized"]]
        r, _ = await pool.call(s.addrs[0], "pull", {"streamlets": [[s.id, 0, 0, {}]]}, timeout=5)
        assert r["errors"][0][2] == "unauthorized" and not r["entries"]
    async with open_admin(coord, settings(cluster)) as a:
        await a.delete_stream("n-data")


async def test_literal_and_prefixed_allows_and_deny_wins(cluster):
    coord = cluster.coordinator
    async with open_admin(coord, settings(cluster)) as a:
        await a.create_streams(["lit", "sens-1", "sens-2", "other"], replication=2)
    alice = await add_user(cluster, "alice", allow("alice", "write", "stream", "lit"),
                           allow("alice", "read", "stream", "lit"),
                           allow("alice", "all", "stream", "sens-", "prefixed"),
                           allow("alice", "read", "stream", "sens-2", permission="deny"))
    async with open_producer(coord, alice) as p:
        for name in ("lit", "sens-1", "sens-2"):
            await p.send(name, name.encode())
        await p.flush()
        assert p.acked == 3
    for name, ok in (("lit", True), ("sens-1", True), ("sens-2", False)):
        async with open_consumer([name], coord, alice) as c:
            if ok:
                assert await read_values(c, 1) == [name.encode()]
            else:
                with pytest.raises(Unauthorized):   # deny beats the prefixed allow
                    await read_values(c, 1)
    async with open_admin(coord, alice) as a:
        assert sorted(s.name for s in await a.list_streams()) == ["lit", "sens-1", "sens-2"]
        assert await code_of(a.describe_stream("other")) == "unauthorized"
        await a.create_stream("sens-3", replication=2)       # "all" on the prefix: create too
        await a.delete_stream("sens-3")
        assert await code_of(a.create_stream("lit-2")) == "unauthorized"   # literal: that name only


async def test_a_lookup_refuses_only_the_names_it_may_not_describe(cluster):
    """Kafka answers TOPIC_AUTHORIZATION_FAILED per topic: a metadata page naming a stream the
    caller may not describe answers the others, and says which it refused, whether they
    exist or not. A producer's lookup of both at once fails only the refused stream's
    records, with the refusal in their reports. A write decision a connection keeps for a
    stream goes with the ACL that made it."""
    coord = cluster.coordinator
    async with open_admin(coord, settings(cluster)) as a:
        await a.create_streams(["pn-mine", "pn-theirs"], replication=2)
    grant = allow("dora", "write", "stream", "pn-mine")
    dora = await add_user(cluster, "dora", grant, allow("dora", "write", "stream", "pn-none"))
    async with open_admin(coord, dora) as a:
        r = await a.call("metadata", names=["pn-theirs", "pn-mine", "pn-secret", "pn-none"])
        assert [s["name"] for s in r["streams"]] == ["pn-mine"]
        assert r["refused"] == ["pn-theirs", "pn-secret"] and r["missing"] == ["pn-none"]
        with pytest.raises(Unauthorized) as e:   # describing is all or nothing for a caller
            await a.describe_streams(["pn-mine", "pn-theirs"])
        assert e.value.refused == ["pn-theirs"]
    async with open_producer(coord, dora, **{"linger.ms": 50}) as p:   # one lookup for both
        mine = [await p.send("pn-mine", b"%d" % i, report=True) for i in range(3)]
        theirs = [await p.send("pn-theirs", b"x", report=True) for _ in range(2)]
        await p.flush()
        assert [(await m).stream for m in mine] == ["pn-mine"] * 3
        for t in theirs:
            with pytest.raises(Unauthorized, match="pn-theirs"):
                await t
        assert p.acked == 3 and p.metadata_requests == 1
        async with open_admin(coord, settings(cluster)) as a:   # revoked: the same connection
            await a.remove_acl(grant)                            # is refused at once
        late = await p.send("pn-mine", b"late", report=True)
        await p.flush()
        with pytest.raises(Unauthorized):
            await late
        assert p.acked == 3
    async with open_admin(coord, settings(cluster)) as a:
        await a.delete_stream("pn-mine")
        await a.delete_stream("pn-theirs")


async def test_consumer_groups_and_the_key_value_map_take_their_rights(cluster):
    coord = cluster.coordinator
    async with open_admin(coord, settings(cluster)) as a:
        await a.create_stream("g-data", replication=2)
    async with open_producer(coord, settings(cluster)) as p:
        for i in range(10):
            await p.send("g-data", b"%d" % i)
    bob = await add_user(cluster, "bob", allow("bob", "read", "stream", "g-data"),
                         allow("bob", "read", "stream", "map-bob"),
                         allow("bob", "write", "stream", "map-bob"))
    async with open_consumer(["g-data"], coord, bob) as c:   # no group: reads
        assert len(await read_values(c, 10)) == 10
    with pytest.raises(Unauthorized):   # no right on the group: neither its positions nor a commit
        async with open_consumer(["g-data"], coord, bob, group="bobs") as c:
            await c.commit()
    async with open_admin(coord, settings(cluster)) as a:
        await a.add_acl(allow("bob", "read", "group", "bob", "prefixed"))
    async with open_consumer(["g-data"], coord, bob, group="bobs") as c:
        assert len(await read_values(c, 10)) == 10
        await c.commit()
    async with open_consumer(["g-data"], coord, bob, group="bobs") as c:   # from where it stopped
        assert await read_values(c, 0, surplus=1.0) == []
        assert (await c.committed())["g-data/0"]["low"] >= 0
    # a map on stream S takes S's rights (and create to make it)
    with pytest.raises(Unauthorized):
        async with open_kv("map-bob", coord, config=bob) as m:
            pass
    async with open_kv("map-bob", coord, config=settings(cluster)) as m:
        await m.put("k", "v0")
    async with open_kv("map-bob", coord, config=bob) as m:
        assert await m.get("k") == b"v0"
        await m.put("k", "v1")
    carol = await add_user(cluster, "carol", allow("carol", "read", "stream", "map-bob"))
    async with open_kv("map-bob", coord, config=carol) as m:
        assert await m.get("k") == b"v1"
        with pytest.raises(Unauthorized):
            await m.put("k", "v2")


def kera(c, *args, config: dict | None = None, stdin: str | None = None, env=None):
    e = {k: v for k, v in os.environ.items() if k != "KERA_CONFIG"}
    e.update({"KERA_COORDINATOR": c.coordinator, **(env or {})})
    if config is not None:
        path = os.path.join(c.data, f"{config.get('sasl.username', 'none')}.conf")
        client_config.write(path, config)
        args = (*args, "--config", path)
    return subprocess.run([sys.executable, "-m", "kera", *args], input=stdin, capture_output=True,
                          text=True, env=e, timeout=60)


def test_the_cli_with_config_files_and_kera_config(cluster, tmp_path):
    admin = settings(cluster)
    pw = tmp_path / "pw"
    pw.write_text("dave-pw\n")
    assert kera(cluster, "user", "add", "dave", "--password-file", str(pw), config=admin).returncode == 0
    dave = settings(cluster, "dave", "dave-pw")
    r = kera(cluster, "user", "list", config=admin)
    assert "dave\tSCRAM-SHA-256,SCRAM-SHA-512" in r.stdout.splitlines()
    assert kera(cluster, "stream", "create", "cli-s", "--replication", "2", config=admin).returncode == 0
    assert kera(cluster, "stream", "create", "cli-t", "--replication", "2").returncode != 0   # nobody
    r = kera(cluster, "produce", "cli-s", config=dave, stdin="a\nb\n")
    assert "acknowledged: 0" in r.stdout and "unauthorized" in r.stderr.lower()
    assert kera(cluster, "acl", "add", "--allow", "User:dave", "--operation", "write", "--stream",
                "cli-", "--prefixed", config=admin).returncode == 0
    assert kera(cluster, "acl", "add", "--allow", "User:dave", "--operation", "read", "--stream",
                "cli-s", config=admin).returncode == 0
    r = kera(cluster, "acl", "list", "--principal", "User:dave", config=admin)
    assert r.stdout.splitlines() == ["allow User:dave write on stream 'cli-' (prefixed)",
                                     "allow User:dave read on stream 'cli-s'"]
    r = kera(cluster, "produce", "cli-s", config=dave, stdin="a\nb\n")
    assert "acknowledged: 2" in r.stdout, r.stderr
    r = kera(cluster, "consume", "cli-s", "--max", "2", "--timeout", "5", config=dave)
    assert r.stdout.splitlines() == ["a", "b"]
    assert kera(cluster, "stream", "list", config=dave).stdout.splitlines() == ["cli-s\t1 streamlets\tR=2"]
    assert kera(cluster, "status", config=dave).returncode != 0   # describe on the cluster: no
    conf = os.path.join(cluster.data, "dave.conf")   # KERA_CONFIG names the same file
    assert kera(cluster, "status", env={"KERA_CONFIG": cluster.client_conf}).returncode == 0
    r = kera(cluster, "consume", "cli-s", "--max", "2", "--timeout", "5", env={"KERA_CONFIG": conf})
    assert r.stdout.splitlines() == ["a", "b"]
    assert kera(cluster, "acl", "remove", "--allow", "User:dave", "--operation", "read", "--stream",
                "cli-s", config=admin).returncode == 0
    r = kera(cluster, "consume", "cli-s", "--max", "2", "--timeout", "3", config=dave)
    assert r.stdout == "" and "unauthorized" in r.stderr.lower()
    assert kera(cluster, "user", "delete", "dave", config=admin).returncode == 0
    r = kera(cluster, "stream", "list", config=dave)
    assert r.returncode != 0 and "authentication_failed" in r.stderr
