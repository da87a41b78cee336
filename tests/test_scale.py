"""The metadata plane at scale: 100,000 streams survive a whole-cluster restart; listings
come a page at a time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import trio
from kera_client import open_admin, open_consumer

from kera import limits
from kera.errors import InvalidArgument, KeraError, LimitExceeded

from .workload import consume_all, create, send_and_flush, status

STREAMS = 100_000
WITH_DATA = 200     # streams that also carry records and a consumer group's positions


async def first_unserved(coord) -> str | None:
    """A stream some streamlet of which has no live owner, or None once every one is served
    (a listing stops at the first such stream: cheap while recovery is still going on)."""
    async with open_admin(coord) as a:
        async for s in a.iter_streams():
            if not all(s.addrs):
                return s.name
    return None


async def serving(coord) -> None:
    """Until the coordinator answers and every stream has live owners again."""
    await status(coord)
    while True:
        try:
            if await first_unserved(coord) is None:
                return
        except KeraError:   # brokers still rejoining; asked again below
            pass
        await trio.sleep(0.2)


async def test_100k_streams_survive_a_whole_cluster_restart(make_cluster):
    """3 nodes, R=3, one streamlet each: metadata, records and committed positions come back."""
    cluster = make_cluster(3)
    coord = cluster.coordinator
    names = [f"s{i:06d}" for i in range(STREAMS)]
    data = names[:: STREAMS // WITH_DATA]
    with trio.fail_after(50):
        await create(coord, names, streamlets=1, replication=3)
        await send_and_flush(coord, data, producer=0, n=5)
        async with open_consumer(data, coord, group="g") as c:   # reads and commits producer 0's
            got = 0
            while got < 5 * len(data):
                got += sum(len(ch) for ch in await c.poll_chunks(1.0))
            await c.commit()
            committed = await c.committed()
        await send_and_flush(coord, data, producer=1, n=5)       # left for after the restart
        assert len(committed) == len(data)

    cluster.kill_all()
    t0 = time.monotonic()
    cluster.start()   # same data dir: the coordinator's metadata log, the backups' segments
    coord = cluster.coordinator
    with trio.fail_after(60):
        await serving(coord)
        print(f"\n{STREAMS} streams: restart to serving {time.monotonic() - t0:.1f} s")
        async with open_admin(coord) as a:
            listed = await a.list_streams()
            assert [s.name for s in listed] == names
            assert all(s.streamlets == 1 and s.replication == 3 for s in listed)
        async with open_consumer(data, coord, group="g") as c:
            assert await c.committed() == committed
        # the group goes on where it committed: producer 1's records, none of producer 0's again
        ledger = await consume_all(coord, data, 5 * len(data), group="g")
    ledger.check({(s, 1): 5 for s in data})


async def test_listing_pages_with_patterns(make_cluster):
    cluster = make_cluster(1)
    coord = cluster.coordinator
    names = [f"p-{i:05d}" for i in range(2 * limits.MAX_LIST_PAGE + 7)] + ["q-1", "q-2"]
    with trio.fail_after(60):
        await create(coord, names, replication=1)
        async with open_admin(coord) as a:
            assert [s.name for s in await a.list_streams()] == names
            assert [s.name for s in await a.list_streams("q-*")] == ["q-1", "q-2"]
            assert [s.name for s in await a.list_streams("*-1")] == ["q-1"]
            assert [s.name async for s in a.iter_streams("p-*", page=100)] == names[:-2]
            # a page: in order, from just after `after`, `next` where the following one starts
            r = await a.call("list_streams", pattern="p-*", after="p-00009", limit=5)
            assert [s["name"] for s in r["streams"]] == names[10:15] and r["next"] == "p-00014"
            r = await a.call("list_streams", pattern="q-*", after="q-1")
            assert [s["name"] for s in r["streams"]] == ["q-2"] and r["next"] is None
            for bad, err in (({"limit": 0}, InvalidArgument), ({"limit": "5"}, InvalidArgument),
                             ({"after": 7}, InvalidArgument), ({"pattern": ["p*"]}, InvalidArgument),
                             ({"limit": limits.MAX_LIST_PAGE + 1}, LimitExceeded)):
                with pytest.raises(err):
                    await a.call("list_streams", **bad)
    out = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "kera", "stream", "list", "p-*"], capture_output=True, text=True,
        timeout=60, env={**os.environ, "KERA_COORDINATOR": coord}))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{n}\t1 streamlets\tR=1" for n in names[:-2]]
