"""One streamlet of a stream as a client's log: read to its durable end, append to it.

What the key-value map (``kv``) and consumer-group positions (``positions``)
share. ``sync`` asks the owner for its ``tail`` (everything appended so far is
durable, and a token names that state), then reads the streamlet up to it, each
chunk handed to a fold: the caller's state then includes every write
acknowledged before the call. ``append`` sends one chunk of this writer's
(producer id, sequence) until the owner answers, following the streamlet to
its new owner after a failure; a chunk whose answer was lost is acknowledged
as a duplicate on the resend, never applied twice.
"""

from __future__ import annotations

import trio

from kera import chunk as chunkfmt
from kera.errors import Conflict, KeraError, Unavailable, from_wire
from kera.position import DONE

from .admin import suspect
from .reader import Reader

RETRY = 0.05


def caught_up(pos: dict, tail: dict) -> bool:
    """The consumer position ``pos`` is at or past the ``tail`` positions in every group."""
    for gid, end in tail["groups"].items():
        gid = int(gid)
        if gid < pos["low"]:
            continue
        cur = pos["groups"].get(gid, 0)
        if cur != DONE and (end == DONE or cur < end):
            return False
    return True


class StreamletLog:
    """Streamlet ``streamlet`` of stream ``name``, read from its start by ``sync``."""

    def __init__(self, pool, coordinator: str, name: str, streamlet: int = 0, timeout: float = 30.0):
        self.pool, self.name, self.streamlet, self.timeout = pool, name, streamlet, timeout
        self.coordinator = coordinator
        self.reader = self._reader()
        self.producer_id = 0       # taken on the first append
        self.producer_token = b""  # issued with it
        self.sequence = 0          # of our next chunk: advanced only when one is appended
        self._unsure = False       # the last chunk sent got no answer (see append)

    def _reader(self) -> Reader:
        return Reader(self.pool, self.coordinator, [self.name], start="earliest",
                             streamlets=[self.streamlet])

    async def open(self) -> None:
        await self.reader._metadata()

    async def reread(self) -> None:
        """Read again from the start at the next ``sync`` (the caller drops what it folded):
        on a compacted stream, a reader that stopped long enough to miss a tombstone removed
        after ``delete.retention.ms`` would otherwise keep the deleted key."""
        self.reader = self._reader()
        await self.reader._metadata()

    def _owner(self) -> tuple[str | None, dict]:
        s = self.reader.streams[self.name]
        return s.addrs[self.streamlet], s

    async def sync(self, fold) -> list:
        """Read to the durable end as of now, ``fold(chunk)`` for each new chunk; returns the
        tail's token."""
        deadline = trio.current_time() + self.timeout
        while True:
            addr, s = self._owner()
            try:
                if addr is None:
                    raise Unavailable(f"stream {self.name} streamlet {self.streamlet} has no live owner yet")
                r, _ = await self.pool.call(addr, "tail", {"stream_id": s.id, "streamlet": self.streamlet},
                                            timeout=max(0.1, deadline - trio.current_time()))
                break
            except KeraError as e:
                await self._moved(addr, e, deadline)
        key = (self.name, self.streamlet)
        while not caught_up(self.reader.positions[key], r):
            if trio.current_time() > deadline:
                raise Unavailable(f"stream {self.name}: could not read to its end in {self.timeout} s")
            for ch in await self.reader.poll_chunks(0.5):
                fold(ch)
        return r["token"]

    async def _moved(self, addr, err: KeraError, deadline: float) -> None:
        """The owner did not answer or refused: look it up again, then retry (until deadline)."""
        if trio.current_time() > deadline or not err.retriable and err.code not in (
                "not_owner", "recovering", "fenced"):
            raise err
        if addr is not None and err.code == "unavailable":
            self.pool.drop(addr)
            await suspect(self.reader.coordinator, addr)
        await trio.sleep(RETRY)
        try:
            await self.reader._metadata()
        except KeraError:
            pass

    async def append(self, method: str, meta: dict, values: list[bytes], keys: list[bytes]) -> bool:
        """One chunk of these records through ``method`` (``produce`` with acks all, or
        ``append_if`` with a token), sent until answered: True once durable, False if
        refused with ``conflict`` (then nothing was appended)."""
        deadline = trio.current_time() + self.timeout
        if not self.producer_id:
            r, _ = await self.reader.coordinator.call("producer_id", {}, timeout=self.timeout)
            self.producer_id, self.producer_token = r["id"], r["token"]
        meta = {**meta, "producer": self.producer_id, "token": self.producer_token}
        addr, s = self._owner()
        data = chunkfmt.build(s.id, self.streamlet, self.producer_id, self.sequence, values, keys,
                              flags=chunkfmt.SEQ_RESET if self._unsure else 0)
        try:
            while True:
                try:
                    if addr is None:
                        raise Unavailable(f"stream {self.name} streamlet {self.streamlet} has no live owner yet")
                    r, _ = await self.pool.call(addr, method, meta, data,
                                                timeout=max(0.1, deadline - trio.current_time()))
                    if r.get("errors"):   # produce names the chunks it refused
                        raise from_wire({"code": r["errors"][0][1], "message": f"{method} refused the chunk"})
                    break
                except Conflict:
                    return False
                except KeraError as e:
                    if e.code == "unknown_producer":   # a new owner knows nothing of us: a new base
                        data = chunkfmt.with_flags(data, chunkfmt.SEQ_RESET)
                    await self._moved(addr, e, deadline)
                    addr, _ = self._owner()
        except BaseException:
            # the chunk may land later or not at all: the next one starts a new
            # sequence base, so neither can be taken for the other
            self.sequence += 1
            self._unsure = True
            raise
        self.sequence += 1
        self._unsure = False
        return True
