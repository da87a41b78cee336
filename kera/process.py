"""Running a server process: one trio loop, stopped cleanly by SIGTERM/SIGINT.

With ``KERA_PROFILE=DIR`` in the environment, the process runs under cProfile
and writes ``DIR/<pid>.prof`` when it stops (for finding hot spots).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import socket
import sys
import time

import trio

# Servers hold millions of long-lived objects (streams, segments, chunk refs) and
# allocate freely per request. With CPython's default thresholds (700, 10, 10) a
# request that allocates a few thousand objects can land on a full collection
# that walks the whole heap (100-300 ms at 100,000 streams). Collecting the young
# generation after 50,000 allocations keeps those collections few; collecting the
# middle one every 10 of them bounds what it walks (the survivors of 500,000
# allocations, ~50 ms: with every 50, the middle generation held millions of new
# streamlets' objects while a broker took its first chunks at 1,000,000 streams,
# and each of its collections stood the event loop still for 0.3-0.6 s, long
# enough to miss heartbeats); the full collections stay as rare as they were
# (every 5,000 young ones). Reference counting frees almost everything anyway.
GC_THRESHOLDS = (50_000, 10, 500)
GC_PAUSE_LOG = 0.2   # seconds: a longer collection is logged


_gc_started = 0.0


def _gc_pauses(phase: str, info: dict) -> None:
    """Log a collection long enough to matter to heartbeats (the event loop stands still)."""
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
        return
    took = time.perf_counter() - _gc_started
    if took > GC_PAUSE_LOG:
        logging.getLogger("kera.gc").warning(
            "collection of generation %d took %.2f s (%d freed)", info["generation"], took,
            info["collected"])


def run_until_signal(async_fn, *args) -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    if _gc_pauses not in gc.callbacks:
        gc.callbacks.append(_gc_pauses)
    async def main():
        async with trio.open_nursery() as nursery:
            async def watch_signals():
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for _ in sigs:
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch_signals)
            await async_fn(*args)
            nursery.cancel_scope.cancel()

    prof_dir = os.environ.get("KERA_PROFILE")
    prof = None
    if prof_dir:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
    finally:
        if prof is not None:
            prof.disable()
            os.makedirs(prof_dir, exist_ok=True)
            prof.dump_stats(os.path.join(prof_dir, f"{os.getpid()}.prof"))
    sys.stdout.flush()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """A base port P with P .. P + n - 1 free, chosen below the kernel's ephemeral range.

    Ports given out by ``bind(0)`` and outgoing connections come from the ephemeral range,
    so a range chosen there can be taken by any other process between this check and the
    server's bind; below it, only another explicit choice can collide."""
    top = _ephemeral_low() - n
    for _ in range(500):
        base = random.randrange(10000, top)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below {top + n}")
