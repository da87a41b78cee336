"""A trio loop in a background thread, for the synchronous client APIs."""

from __future__ import annotations

import threading

import trio


class Portal:
    def __init__(self, name: str = "kera-client"):
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        async def main():
            self._stop = trio.Event()
            async with trio.open_nursery() as n:
                self.nursery = n
                self.token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
                n.cancel_scope.cancel()

        try:
            trio.run(main)
        except BaseException as e:  # surfaced to the thread that waits
            self._error = e
            self._ready.set()

    def call(self, afn, *args):
        """Run ``afn(*args)`` in the loop and wait for its result."""
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    def start(self, afn, *args):
        """Start a long-lived task in the loop's nursery; returns what it passes to started()."""
        async def go():
            return await self.nursery.start(afn, *args)
        return self.call(go)

    def run_sync_soon(self, fn, *args) -> None:
        self.token.run_sync_soon(fn, *args)

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self.token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:
                pass
            self._thread.join()


class Synced:
    """A synchronous face for an async client: the object ``opener(*args, **kw)`` yields
    (an async context manager) lives in a background trio loop, and each of its
    coroutine methods, called from here, runs there and is waited for."""

    def __init__(self, name: str, opener, *args, **kw):
        self.portal = Portal(name)
        try:
            self._obj = self.portal.start(self._serve, opener, args, kw)
        except BaseException:
            self.portal.close()
            raise

    @staticmethod
    async def _serve(opener, args, kw, task_status):
        async with opener(*args, **kw) as obj:
            task_status.started(obj)
            await trio.sleep_forever()

    def __getattr__(self, name):
        if name == "_obj":   # not started (a failed __init__): no recursion
            raise AttributeError(name)
        fn = getattr(self._obj, name)
        return lambda *a, **k: self.portal.call(lambda: fn(*a, **k))

    def close(self) -> None:
        self.portal.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
