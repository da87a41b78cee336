"""One process of the many-committers test: ``COUNT`` consumers (groups ``g<FIRST>`` ...)
of stream ``STREAM``, each committing every 100 ms through ``AsyncConsumer.commit`` for
``SECONDS``, all with the process's one ``GroupPositions``. The positions are synthetic (group 0 at the commit's number), so what each
group committed last is known. Prints ``ready`` once every consumer committed once, and
writes each group's last acknowledged number and every commit's latency and end to OUT.

    python -m tests.positions_worker COORD STREAM FIRST COUNT SECONDS OUT
"""

from __future__ import annotations

import json
import sys
import time

import trio
from kera_client import AsyncConsumer
from kera_client.positions import GroupPositions

from kera.rpc import open_pool

PERIOD = 0.1


async def main(coord, stream, first, count, seconds, out):
    last: dict[str, int] = {}
    latencies: list[float] = []
    done_at: list[float] = []   # monotonic, the same clock in every process of the machine
    started = 0
    all_started = trio.Event()

    async def one(group: str, end_of: list):
        nonlocal started
        c = AsyncConsumer(pool, coord, [stream], group=group, positions=shared)
        await c._metadata()
        n = 0
        while True:
            n += 1
            c.positions[(stream, 0)] = {"low": 0, "groups": {0: n}}
            c._moved((stream, 0))   # (a commit stores the positions moved since the last)
            t0 = time.monotonic()
            await c.commit()
            if n > 1:   # the first one also finds the positions stream
                done_at.append(time.monotonic())
                latencies.append(done_at[-1] - t0)
            last[group] = n
            if n == 1:
                started += 1
                if started == count:
                    all_started.set()
            if end_of and time.monotonic() >= end_of[0]:
                return
            await trio.sleep_until(trio.current_time() + max(0.0, PERIOD - (time.monotonic() - t0)))

    async with open_pool() as pool:
        shared = GroupPositions(pool, coord)   # the process's commits leave together
        end_of: list[float] = []
        async with trio.open_nursery() as n:
            for k in range(first, first + count):
                n.start_soon(one, f"g{k}", end_of)
            await all_started.wait()
            print("ready", flush=True)
            end_of.append(time.monotonic() + seconds)
    with open(out, "w") as f:
        json.dump({"last": last, "latencies": latencies, "done_at": done_at}, f)


if __name__ == "__main__":
    coord, stream, first, count, seconds, out = sys.argv[1:7]
    trio.run(main, coord, stream, int(first), int(count), float(seconds), out)
