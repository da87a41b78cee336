"""Running a server process: one trio loop, stopped cleanly by SIGTERM/SIGINT."""

from __future__ import annotations

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

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
