"""A whole-cluster kill -9 and restart with 1,000,000 streams, 100,000 of them holding data.

    python -m bench restart [--quick] [--counts STREAMS,WITH_DATA]

3 nodes, R=3, default broker settings, streams of one streamlet: create them,
one producer sends one record to each of the streams holding data (their
values name their stream), then every process of the cluster is killed with
SIGKILL and started again on the same data dirs. Timed: from the start to the
coordinator answering, and to every stream having a live owner again (a
listing of them all, a page at a time, finds none unserved; the time of the
pass that does is included and given apart; a pass stops at the first stream not
served yet). Then a consumer subscribed by
pattern reads the records back: each stream's one record, exactly, nothing
twice. ``--quick``: 100,000 streams, 10,000 holding data.

Too long for the test suite (creating the streams alone takes most of a
minute here); tests/test_scale.py restarts 100,000 streams, 200 with data.
"""

from __future__ import annotations

import time

import numpy as np
import trio
from kera_client import open_admin, open_consumer, open_producer
from kera_client.metadata import pages

from kera.errors import KeraError, Unavailable

from .kera_side import KeraRun


def value(name: str) -> bytes:
    return name.encode().ljust(100, b".")


async def first_unserved(coord) -> str | None:
    """The first stream (in name order) a streamlet of which has no live owner, None once a
    listing of them all finds none: a pass stops there, since a whole listing of 1,000,000
    streams every half second was most of the load on the coordinator it waited for. Each
    page is checked as its columns (an owner whose address is None is not alive), not as a
    view per stream: with views, the pass that found all 1,000,000 served took 23.6 s of
    this client's time, longer than the coordinator took to list them."""
    async with open_admin(coord) as a:
        async for cols in pages(a.coordinator, "*", timeout=a.timeout):
            dead = np.array([addr is None for _, addr in cols.members] or [False], bool)
            if dead[cols.owner].any():
                stream = np.searchsorted(cols.first, np.flatnonzero(dead[cols.owner])[0], "right") - 1
                return cols.names[stream]
    return None


async def load(coord, idle: int, data: int) -> dict:
    names = [f"d{i:07d}" for i in range(data)] + [f"i{i:07d}" for i in range(idle)]
    t0 = time.monotonic()
    async with open_admin(coord) as a:
        for i in range(0, len(names), 4096):
            await a.create_streams(names[i:i + 4096], streamlets=1, replication=3)
    create_s = time.monotonic() - t0
    t0 = time.monotonic()
    async with open_producer(coord) as p:
        for n in names[:data]:
            await p.send(n, value(n))
        await p.flush()
        acked = p.acked
    return {"create_s": round(create_s, 2), "produce_s": round(time.monotonic() - t0, 2), "acked": acked}


async def back(coord, t0: float, data: int) -> dict:
    while True:   # the coordinator answers once its nodes rejoined
        try:
            async with open_admin(coord) as a:
                await a.status()
            break
        except Unavailable:
            await trio.sleep(0.1)
    answering = time.monotonic() - t0
    while True:
        t = time.monotonic()
        try:
            if await first_unserved(coord) is None:
                break
        except KeraError:   # brokers still rejoining
            pass
        await trio.sleep(0.5)
    serving, pass_s = time.monotonic() - t0, time.monotonic() - t
    async with open_admin(coord) as a:   # each attempt, so an outlier says why (a failed one)
        recoveries = [{k: r.get(k) for k in ("broker", "epoch", "state", "seconds", "error")}
                      for r in (await a.status())["recoveries"]]
    got: dict[str, bytes] = {}
    twice = 0
    t = time.monotonic()
    async with open_consumer(None, coord, pattern="d*") as c:
        with trio.move_on_after(600):
            while len(got) < data:
                for ch in await c.poll_chunks(1.0):
                    for v in ch.values():
                        twice += ch.stream in got
                        got[ch.stream] = v
        for ch in await c.poll_chunks(0.5):
            twice += len(ch)
    exact = sum(got.get(n) == value(n) for n in (f"d{i:07d}" for i in range(data)))
    return {"answering_s": round(answering, 2), "serving_s": round(serving, 2),
            "unserved_pass_s": round(pass_s, 2), "read_s": round(time.monotonic() - t, 2),
            "read": len(got), "exact": exact, "twice": twice, "recoveries": recoveries}


def run(args, say) -> dict:
    streams, data = ([int(x) for x in args.counts.split(",")] if args.counts else
                     (100_000, 10_000) if args.quick else (1_000_000, 100_000))
    say(f"restart: kera R=3, {args.nodes} nodes, {streams:,} streams, {data:,} holding one record")
    with KeraRun(args.nodes) as k:
        before = trio.run(load, k.cluster.coordinator, streams - data, data)
        say(f"   {before}")
        k.cluster.kill_all()
        t0 = time.monotonic()
        k.cluster.start()
        after = trio.run(back, k.cluster.coordinator, t0, data)
    row = {"system": "kera R=3", "streams": streams, "with_data": data, **before, **after,
           "pass": after["exact"] == data == before["acked"] and after["twice"] == 0
           and after["serving_s"] <= 60}
    say(f"   {row}")
    return {"experiment": "restart", "nodes": args.nodes, "rows": [row], "target_s": 60,
            "notes": "serving_s: from starting the killed cluster again to a listing of every "
                     "stream finding each served (that pass's own time: unserved_pass_s); "
                     "answering_s: to the coordinator answering status"}
