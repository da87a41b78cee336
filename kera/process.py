"""Running a server process: one trio loop, stopped cleanly by SIGTERM/SIGINT.

With ``KERA_PROFILE=DIR`` in the environment, the process runs under cProfile
and writes ``DIR/<pid>.prof`` when it stops (for finding hot spots).
"""

from __future__ import annotations

import os
import signal
import sys

import trio


def run_until_signal(async_fn, *args) -> None:
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
