"""The ingest path end to end, against real processes."""

from __future__ import annotations

import time

import numpy as np
import trio
from kera_client import open_admin, open_consumer

from .workload import Ledger, consume_all, produce_all, read_values


async def test_million_records_256_streams_4_producers(make_cluster):
    cluster = make_cluster(3)
    coord = cluster.coordinator
    streams = [f"s{i:03d}" for i in range(256)]
    async with open_admin(coord) as a:
        for s in streams:
            await a.create_stream(s, streamlets=1)
        owners = {(await a.describe_stream(s)).owners[0][0] for s in streams[:12]}
        assert len(owners) == 3, "streams are spread over the brokers"
    producers, per_pair = 4, 1_000_000 // (4 * 256) + 1
    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            n.start_soon(produce_all, coord, streams, producers, per_pair, 4)
        ledger = await consume_all(coord, streams, producers * per_pair * len(streams))
    assert ledger.records >= 1_000_000
    ledger.check({(s, p): per_pair for s in streams for p in range(producers)})


async def test_active_groups_close_and_reopen(make_cluster):
    cluster = make_cluster(2)
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        # small segments and G=2 so groups fill and close quickly
        await a.create_stream("groups", streamlets=4, groups=4, replication=1,
                              segment_size=16384, group_segments=2)
    producers, per = 8, 3000
    with trio.fail_after(120):
        await produce_all(coord, ["groups"], producers, per, 3, **{"chunk.size": 2048})
        ledger = Ledger()
        placements = []
        async with open_consumer(["groups"], coord) as c:
            while ledger.records < producers * per:
                for ch in await c.poll_chunks(2.0):
                    ledger.add(ch)
                    h = ch.view.header
                    placements.append((ch.streamlet, h.producer_id, ch.group, h.segment))
    ledger.check({("groups", p): per for p in range(producers)})
    # a producer's chunks all go to active group slot (producer id % Q): groups of
    # producers in different slots never mix, and every group holds one slot only
    slot_of_group = {}
    for streamlet, pid, group, segment in placements:
        assert segment < 2, "a group never has more than G segments"
        assert slot_of_group.setdefault((streamlet, group), pid % 4) == pid % 4
    groups_per_streamlet = {}
    for streamlet, group in slot_of_group:
        groups_per_streamlet.setdefault(streamlet, set()).add(group)
    for streamlet, gs in groups_per_streamlet.items():
        assert len(gs) > 4, f"streamlet {streamlet}: groups closed and new ones opened ({sorted(gs)})"
        slots = {slot_of_group[(streamlet, g)] for g in gs}
        assert slots == {0, 1, 2, 3}, "the Q active groups were all used"


async def test_send_many_and_sync_clients_round_trip(make_cluster):
    """The batch path (lists with keys, arrays) and the synchronous Producer/Consumer."""
    cluster = make_cluster(1)
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        await a.create_stream("many", streamlets=3, replication=1)
    values = [b"v%d" % i for i in range(5000)]
    keys = [None if i % 3 == 0 else b"k%d" % (i % 7) for i in range(5000)]

    def sync_side():
        from kera_client import Consumer, Producer

        with Producer(coord, **{"chunk.size": 2048}) as p:
            p.send_many("many", values, keys)
            p.send_many("many", np.full((100, 10), ord("a"), dtype=np.uint8), streamlet=1)
            for i in range(50):
                p.send("many", b"one-%d" % i, key=b"key")
        with Consumer(["many"], coordinator=coord) as c:
            # polled up to the count sent (an empty poll is not the end), then any surplus
            got, deadline = [], time.monotonic() + 30
            while len(got) < 5150 and time.monotonic() < deadline:
                got += c.poll(1.0)
            return got + list(c.records(timeout=0.5))

    got = await trio.to_thread.run_sync(sync_side)
    assert len(got) == 5150
    by_value = {r.value: r.key for r in got}
    assert all(by_value[v] == k for v, k in zip(values, keys, strict=True))
    assert sum(1 for r in got if r.value == b"a" * 10) == 100
    one = [r for r in got if r.value.startswith(b"one-")]
    assert [r.value for r in one] == [b"one-%d" % i for i in range(50)]  # one key: one streamlet, in order


async def test_committed_positions_resume_a_consumer_group(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    async with open_admin(coord) as a:
        await a.create_stream("pos", streamlets=2, replication=1)
    await produce_all(coord, ["pos"], 1, 100, 1)

    async def read_all(group, want):
        async with open_consumer(["pos"], coord, group=group) as c:
            seen = await read_values(c, want)
            await c.commit()
        return seen

    assert len(await read_all("g", 100)) == 100
    await produce_all(coord, ["pos"], 2, 50, 1)  # 100 more, 50 of them from a second producer
    again = await read_all("g", 100)
    assert len(again) == 100 and sum(v[:4] == (1).to_bytes(4, "little") for v in again) == 50
    assert len(await read_all("other", 200)) == 200  # another group starts from the beginning
