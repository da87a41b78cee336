"""Running a server process: one trio loop, stopped cleanly by SIGTERM/SIGINT, its cyclic
collector as servers need it (``kera.collector``).

With ``KERA_PROFILE=DIR`` in the environment, the process runs under cProfile
and writes ``DIR/<pid>.prof`` when it stops (for finding hot spots).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys

import trio

from .collector import full_collections, install


def run_until_signal(async_fn, *args) -> None:
    collector = install()
    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(full_collections, collector)
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
