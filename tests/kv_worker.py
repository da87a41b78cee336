"""One client process of the concurrent map test: random operations on a few keys,
each recorded with its invocation and response times (CLOCK_MONOTONIC, shared by every
process on the machine); an operation without an answer is recorded as unknown.

    python -m tests.kv_worker COORD MAP SECONDS SEED OUT [--reads local]
"""

from __future__ import annotations

import json
import random
import sys
import time

import trio
from kera_client.kv import open_kv

from kera.errors import KeraError

OP_TIMEOUT = 5.0


async def main(coord, name, seconds, seed, out, reads):
    rnd = random.Random(seed)
    history = []
    async with open_kv(name, coord, create=False, timeout=OP_TIMEOUT, reads=reads) as m:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            key = f"k{rnd.randrange(20)}"
            kind = rnd.choice(("put", "get", "get", "cas", "delete"))
            n += 1
            value = f"{seed}-{n}"
            arg = value if kind == "put" else None
            start = time.monotonic()
            try:
                with trio.fail_after(OP_TIMEOUT + 1):
                    if kind == "put":
                        result = await m.put(key, value)
                    elif kind == "get":
                        v = await m.get(key)
                        result = None if v is None else v.decode()
                    elif kind == "cas":
                        cur = rnd.randrange(4)
                        arg = [cur, value]
                        result = await m.compare_and_set(key, cur, value)
                    else:
                        result = await m.delete(key)
                done = time.monotonic()
            except (KeraError, trio.TooSlowError):
                done, result = None, None
            history.append([kind, key, arg, start, done, result])
    with open(out, "w") as f:
        json.dump(history, f)


if __name__ == "__main__":
    coord, name, seconds, seed, out = sys.argv[1:6]
    reads = "local" if "--reads" in sys.argv and sys.argv[-1] == "local" else "linearizable"
    trio.run(main, coord, name, float(seconds), int(seed), out, reads)
