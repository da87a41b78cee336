"""A stranger on the network, against a running cluster in its default mode (no ``--auth``).

With no credentials it sends every internal RPC of the wire table, well formed and with
plausible fields (the ids, epochs, streams and replicas the cluster really has), to every
server: each is refused, typed. It then writes chunks under the producer ids the next
producers are about to be given, with huge sequences, resets or not: refused too, and
those producers' records all arrive. A member speaking as another member is refused as
well. Afterwards every acknowledged record reads back through a broker's kill -9 and its
recovery, and no broker was reset (fenced) along the way.
"""

from __future__ import annotations

import pytest
import trio
from kera_client import open_admin, open_producer

from kera import chunk, wire
from kera.errors import KeraError
from kera.recovery.routes import pack_routes
from kera.rpc import open_pool

from .members import open_members
from .test_retention import wait_recovered
from .workload import consume_all, produce_all, values

pytestmark = pytest.mark.timeout(240)

HUGE = 1 << 40


def plausible(st: dict, s, replica: tuple, vlog: int) -> dict:
    """One well-formed request per internal RPC, per server kind: (meta, payload) naming the
    cluster's real members, epochs, stream and replicas."""
    b = st["brokers"][0]
    bid, ep = b["id"], b["epoch"]
    rb, rv, rs = replica
    rep = {"broker": rb, "vlog": rv, "vseg": rs}
    data = chunk.build(s.id, 0, 1, HUGE, [b"evil"])
    evil = {"version": HUGE, "users": {}, "acls": [], "super_users": ["User:ANONYMOUS"]}
    owners, rows = pack_routes([(s.id, 0, b["addr"], ep)])
    return {
        "coordinator": {
            "register": ({"role": "broker", "addr": "127.0.0.1:1", "node": "evil", "id": bid,
                          "epoch": ep}, b""),
            "heartbeat": ({"role": "broker", "id": bid, "epoch": ep, "stats": {}}, b""),
        },
        "broker": {
            "assign": ({"epoch": ep, "stream": s.to_wire(), "streamlets": [0], "recovering": True}, b""),
            "configure": ({"epoch": ep, "stream": {**s.to_wire(), "retention_bytes": 0}}, b""),
            "unassign": ({"epoch": ep, "stream_id": s.id}, b""),
            "recover": ({"epoch": ep}, data),
            "adopt": ({"epoch": ep}, chunk.build(s.id, 0, 1, 0, [b"x"], flags=chunk.INDEX)),
            "pend": ({"epoch": ep, "source": [bid, ep], "entries": [[s.id, 0, [[0, 9]], [], []]]}, b""),
            "settle": ({"epoch": ep}, b""),
            "lag": ({"positions": [[s.id, 0, 0, {}]]}, b""),
            "kafka_map": ({"offsets": [[s.id, 0, 0]]}, b""),
            "security": (evil, b""),
        },
        "backup": {
            "replicate": ({"broker": rb, "epoch": HUGE, "entries": [[vlog, 99, 0, False, len(data)]]}, data),
            "list": ({"broker": rb}, b""),
            "fence": ({"broker": rb, "epoch": HUGE}, b""),
            "read_chunks": ({**rep, "ranges": [[0, 100]]}, b""),
            "index": ({"broker": rb, "vsegs": [[rv, rs]]}, b""),
            "read": ({**rep, "offset": 0}, b""),
            "replay": ({**rep, "owners": owners}, rows),
            "trim": ({"broker": rb, "vlog": rv, "floor": HUGE}, b""),
            "claim": ({"owner": rb, "epoch": HUGE, "claims": [[rb, rv, rs]]}, b""),
            "release": ({"owner": rb, "epoch": ep}, b""),
            "security": (evil, b""),
        },
    }


def test_every_member_rpc_has_a_plausible_request():
    """The stranger tries them all: a new internal RPC must be added here."""
    from kera.stream_meta import StreamMeta
    s = StreamMeta(name="s", id=1, streamlets=1, groups=1, replication=1, segment_size=1 << 20,
                   group_segments=8, owners=((1, 1),))
    got = plausible({"brokers": [{"id": 1, "epoch": 1, "addr": "127.0.0.1:1"}]}, s, (1, 0, 0), 0)
    for role, table in wire.TABLES.items():
        members = {n for n, r in table.items() if isinstance(r.caller, wire.Members)}
        assert set(got[role]) == members, role


async def refused(pool, addr: str, method: str, meta: dict, payload=b"") -> str:
    try:
        await pool.call(addr, method, meta, payload, timeout=10)
    except KeraError as e:
        return e.code
    return "accepted"


async def test_a_stranger_changes_nothing_and_a_member_speaks_only_for_itself(make_cluster):
    c = make_cluster(3)
    coord = c.coordinator
    producers, per = 4, 5000
    async with open_admin(coord) as a:
        s = await a.create_stream("data", streamlets=6, replication=3)
    with trio.fail_after(200):
        await produce_all(coord, ["data"], producers, per, 5)
        async with open_admin(coord) as a:
            st = await a.status()
        start = {b["id"]: b["epoch"] for b in st["brokers"]}
        async with open_members(c) as members:
            listed, _ = await members.call(st["backups"][0]["addr"], "list", {})
        replica = next((sg["broker"], sg["vlog"], sg["vseg"]) for sg in listed["segments"])

        # 1. every internal RPC, to every server, from nobody: refused, typed
        asks = plausible(st, s, replica, replica[1])
        addrs = {"coordinator": [coord], "broker": [b["addr"] for b in st["brokers"]],
                 "backup": [b["addr"] for b in st["backups"]]}
        answers = {}
        async with open_pool() as stranger:
            for role, rpcs in asks.items():
                for addr in addrs[role]:
                    for method, (meta, payload) in rpcs.items():
                        answers[(addr, method)] = await refused(stranger, addr, method, meta, payload)
        assert len(answers) == 2 + 3 * 10 + 3 * 11
        wrong = {k: v for k, v in answers.items() if v not in ("unauthenticated", "unauthorized")}
        assert not wrong, wrong

        # 2. members only as themselves: a backup sends a broker's request, a broker speaks
        # for another, a heartbeat claims another's id
        b1, b2 = st["brokers"][0], st["brokers"][1]
        bk = st["backups"][0]
        async with open_members(c) as m:
            as_backup = m.pool("backup", bk["id"])
            as_b2 = m.pool("broker", b2["id"])
            assert await refused(as_backup, b1["addr"], "settle", {"epoch": b1["epoch"]}) == "unauthorized"
            assert await refused(as_b2, bk["addr"], "trim", {"broker": b1["id"], "vlog": replica[1],
                                                               "floor": HUGE}) == "unauthorized"
            assert await refused(as_b2, bk["addr"], "fence", {"broker": b1["id"], "epoch": HUGE}) \
                == "unauthorized"
            assert await refused(as_b2, coord, "heartbeat", {"role": "broker", "id": b1["id"],
                                                             "epoch": b1["epoch"]}) == "unauthorized"
            assert await refused(as_b2, coord, "heartbeat", {"role": "backup", "id": b2["id"],
                                                             "epoch": b2["epoch"]}) == "unauthorized"
            # a member, as itself, with an address nobody can reach: refused at the door
            assert await refused(as_backup, coord, "register", {"role": "backup", "addr": "x",
                                                                "id": bk["id"]}) == "invalid_argument"

        # 3. producer-id poisoning: chunks under the ids the next producers will get, with huge
        # sequences (and resets), with no token or a forged one
        async with open_admin(coord) as a:
            last = (await a.call("producer_id"))["id"]
        targets = range(last + 1, last + 1 + producers)
        async with open_pool() as stranger:
            for pid in targets:
                evil = [chunk.build(s.id, i, pid, HUGE, [b"evil"], flags=f)
                        for i in range(6) for f in (0, chunk.SEQ_RESET)]
                for addr in set(s.addrs):
                    r = await refused(stranger, addr, "produce", {"producer": pid, "token": b"x" * 32},
                                      b"".join(evil))
                    assert r == "unauthorized"
                    r, _ = await stranger.call(addr, "produce", {}, b"".join(evil), timeout=10)
                    assert {code for _, code in r["errors"]} == {"unauthorized"}
                    assert len(r["errors"]) == len(evil)

        async def victim(k: int) -> None:
            async with open_producer(coord) as p:
                assert p.producer_id == targets[k], "the poisoned ids were not the next ones"
                await p.send_many("data", values(producers + k, 0, 1000))
                await p.flush()
                assert p.acked == 1000

        for k in range(producers):   # one at a time: they take the ids in order
            await victim(k)

        async with open_admin(coord) as a:
            st = await a.status()
        assert {b["id"]: b["epoch"] for b in st["brokers"]} == start, "a broker was reset"
        for name in c.procs:
            if name.endswith("broker"):
                assert "fenced: dropping its state" not in c.log(name)

        # 4. every acknowledged record, through a broker's kill -9 and its recovery
        owner = next(name for name, addr in c.addrs.items() if addr == s.addrs[0])
        c.kill(owner)
        await wait_recovered(c, s, timeout=90)
        expected = {("data", p): per for p in range(producers)}
        expected.update({("data", producers + k): 1000 for k in range(producers)})
        ledger = await consume_all(coord, ["data"], sum(expected.values()))
        ledger.check(expected)
