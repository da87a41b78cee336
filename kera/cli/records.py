"""``kera produce`` and ``kera consume``: records in from stdin (or generated), out to stdout."""

from __future__ import annotations

import sys
import time

import numpy as np
import trio

from ..errors import KeraError, RecordTooLarge
from .options import client, config, coordinator, describe


def add_parsers(sub) -> None:
    p = client(sub.add_parser("produce", help="produce stdin lines, or --generate synthetic records"))
    p.add_argument("stream")
    p.add_argument("--key", default=None)
    p.add_argument("--keyed", action="store_true", help="stdin lines are key<TAB>value (empty value: tombstone)")
    p.add_argument("--generate", type=int, default=None, metavar="N")
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--acks", choices=["all", "leader", "none"], default=None, help="default all")
    p.add_argument("--linger-ms", type=float, default=None)
    p.add_argument("--chunk-size", type=int, default=None, help="bytes (at most MAX_CHUNK)")
    p.add_argument("--request-size", type=int, default=None, help="bytes (at most MAX_REQUEST)")
    p.add_argument("--max-in-flight", type=int, default=None)

    co = client(sub.add_parser("consume", help="read records of a stream"))
    co.add_argument("stream")
    co.add_argument("--from", dest="start", choices=["earliest", "latest"], default="earliest")
    co.add_argument("--max", type=int, default=None)
    co.add_argument("--timeout", type=float, default=10.0, help="stop after this long with nothing new")
    co.add_argument("--count-only", action="store_true")
    co.add_argument("--keys", action="store_true", help="print key<TAB>value lines")
    co.add_argument("--group", default=None, help="consumer group: start where it stopped, commit at the end")


def _producer_options(args) -> dict:
    """The options given on the command line; the producer's own defaults for the others."""
    opts = {"acks": args.acks, "linger.ms": args.linger_ms, "chunk.size": args.chunk_size,
            "request.size": args.request_size, "max.in.flight": args.max_in_flight}
    return {k: v for k, v in opts.items() if v is not None}


class _Tally:
    """Records acknowledged so far: what a producer that fails still says."""

    acked = 0


def _produce_lines(args, tally: _Tally) -> bool:
    """Each stdin line a record (``--keyed``: key<TAB>value); a line that cannot go is said
    and the others still go. Returns whether every line went."""
    from kera_client import Producer

    ok = True
    key = args.key.encode() if args.key is not None else None
    p = Producer(coordinator(args), {**_producer_options(args), **(config(args) or {})})
    try:
        for n, line in enumerate(sys.stdin.buffer, 1):
            value = line.rstrip(b"\n")
            if args.keyed:   # key<TAB>value; an empty value is a tombstone
                key, tab, value = value.partition(b"\t")
                if not tab:
                    print(f"error: line {n}: --keyed needs key<TAB>value", file=sys.stderr, flush=True)
                    ok = False
                    continue
            try:
                p.send(args.stream, value, key=key)
            except RecordTooLarge as e:  # that line only: the others still go
                print(f"error: line {n}: {e.code}: {e}", file=sys.stderr, flush=True)
                ok = False
        p.flush()
    finally:
        tally.acked = p.acked
        p.portal.close()
    return ok


def _produce_generated(args, tally: _Tally) -> None:
    """``--generate`` N records of ``--size`` printable bytes from ``--producers`` producers,
    and the rate they went at."""
    from kera_client import open_producer

    counts = [0] * args.producers

    async def one(i, n):
        async with open_producer(coordinator(args),
                                 {**_producer_options(args), **(config(args) or {})}) as p:
            try:
                rng = np.random.default_rng(i)
                step = 20_000
                for start in range(0, n, step):
                    m = min(step, n - start)
                    arr = rng.integers(97, 123, size=(m, args.size), dtype=np.uint8)  # printable
                    await p.send_many(args.stream, arr)
                await p.flush()
            finally:
                counts[i] = p.acked

    async def go():
        async with trio.open_nursery() as nursery:
            for i in range(args.producers):
                n = args.generate // args.producers + (i < args.generate % args.producers)
                nursery.start_soon(one, i, n)

    t0 = time.monotonic()
    try:
        trio.run(go)
    finally:
        tally.acked = sum(counts)
    dt = time.monotonic() - t0
    print(f"{tally.acked} records in {dt:.2f} s ({tally.acked / max(dt, 1e-9):,.0f} records/s)",
          file=sys.stderr)


def cmd_produce(args) -> None:
    ok, tally = True, _Tally()
    try:
        if args.generate is None:
            ok = _produce_lines(args, tally)
        else:
            _produce_generated(args, tally)
    except (KeraError, KeyboardInterrupt, BaseExceptionGroup) as e:
        print(f"error: {describe(e)}", file=sys.stderr)
        ok = False
    print(f"acknowledged: {tally.acked}", flush=True)
    if not ok:
        sys.exit(1)


def cmd_consume(args) -> None:
    from kera_client import open_consumer

    count = 0

    async def go():
        nonlocal count
        async with open_consumer([args.stream], coordinator(args), config(args), start=args.start,
                                 group=args.group) as c:
            idle_since = time.monotonic()
            out = sys.stdout.buffer
            while args.max is None or count < args.max:
                left = args.timeout - (time.monotonic() - idle_since)
                if left <= 0:
                    break
                chunks = await c.poll_chunks(min(1.0, left))
                if chunks:
                    idle_since = time.monotonic()
                for j, ch in enumerate(chunks):
                    n = len(ch)
                    if args.max is not None:
                        n = min(n, args.max - count)
                    if not args.count_only:
                        values = ch.values()[:n]
                        if args.keys:
                            values = [(k or b"") + b"\t" + v for k, v in zip(ch.keys(), values, strict=False)]
                        out.write(b"".join(v + b"\n" for v in values))
                    count += n
                    if n < len(ch) or (args.max is not None and count >= args.max):
                        # stopped here: the group resumes at the first record not printed
                        c.rewind(chunks[j:] if n < len(ch) else chunks[j + 1:], n if n < len(ch) else 0)
                        break
            if not args.count_only:
                out.flush()
            if args.group:
                await c.commit()

    try:
        trio.run(go)
    except KeraError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        if args.count_only:
            print(count)
        sys.exit(1)
    if args.count_only:
        print(count)


COMMANDS = {"produce": cmd_produce, "consume": cmd_consume}
