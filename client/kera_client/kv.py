"""A linearizable key-value map on a stream.

Why it is linearizable: the map is a stream of one streamlet, a totally
ordered, replicated log, and the broker that owns it offers two primitives.
``tail`` waits until everything appended so far is durable and names that
state with a token; ``append_if(token)`` appends only if nothing was appended
since (else ``conflict``). Both are served only under the broker's lease,
so a deposed owner never answers after its successor took a write.
The map is a producer like any other: a write whose answer was lost
(timeout, broker death) is sent again as the same chunk, same producer id
and sequence, and the broker acknowledges a copy it already holds instead of
comparing it, so the writer learns the outcome and never applies twice.

- A read (``get``, ``items``) asks for the tail, then reads the stream up to
  it: every write acknowledged before the read began is applied, and nothing
  that could later vanish is (reads stop at the durable end).
- A write reads to the tail, decides against that state (``compare_and_set``
  checks the version there), and appends with the tail's token: it takes
  effect only if the state it decided on is still the log's end. On a
  conflict it reads again and decides again.

So failed attempts never reach the log: every record is a committed
operation, the state is the log's fold, and key compaction (the latest record
per key) keeps exactly that state: the map's stream is created with
``cleanup.policy=compact``, so it holds about one record per live key. A
delete's tombstone is removed ``delete.retention.ms`` (a day by default) after
its segment closed, so a client that has not read for ``REREAD_AFTER`` (an
hour) reads the map again from its start instead of going on from where it
stopped; a map's ``delete.retention.ms`` must stay above that. Records: key = the map key; value =
msgpack ``[version, value]`` for a put, empty for a delete (a tombstone). A
key's version counts its puts since it was last absent, as etcd's does.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import msgpack
import trio

from kera.errors import StreamExists, Unauthorized, UnknownStream
from kera.rpc import open_pool, unwrapped
from kera.security.client_config import credentials

from .admin import AsyncAdmin, default_coordinator
from .portal import Synced
from .streamlet_log import StreamletLog

REREAD_AFTER = 3600.0   # seconds without a read after which a client reads the map from its start


def _key(k) -> bytes:
    return k.encode() if isinstance(k, str) else bytes(k)


class AsyncKVMap:
    """``put``, ``get``, ``put_if_absent``, ``compare_and_set``, ``delete``, ``items``.

    ``reads="local"`` answers reads from what this object last read, with no round trip
    (etcd's serializable reads): fast, possibly stale, not linearizable."""

    def __init__(self, pool, coordinator: str, name: str, timeout: float = 30.0,
                 reads: str = "linearizable"):
        if reads not in ("linearizable", "local"):
            raise ValueError("reads must be 'linearizable' or 'local'")
        self.pool, self.name, self.timeout, self.reads = pool, name, timeout, reads
        self.admin = AsyncAdmin(pool, coordinator, timeout)
        self.log = StreamletLog(pool, coordinator, name, 0, timeout)   # tail, append_if
        self.reader = self.log.reader
        self.state: dict[bytes, tuple[int, bytes]] = {}
        self._synced = time.monotonic()
        self._lock = trio.Lock()   # one operation at a time per map object

    async def open(self, create: bool = True, replication: int | None = None) -> None:
        refused = None
        if create:
            try:
                await self.admin.create_stream(self.name, streamlets=1, groups=1, replication=replication,
                                               cleanup_policy="compact")
            except StreamExists:
                pass
            except Unauthorized as e:   # made already by someone allowed to, or not at all
                refused = e
        try:
            await self.log.open()
        except UnknownStream:
            if refused is not None:
                raise refused from None
            raise

    def _apply(self, ch) -> None:
        for k, v in zip(ch.view.keys(), ch.view.values(), strict=True):
            if not v:
                self.state.pop(bytes(k), None)
                continue
            version, value = msgpack.unpackb(v)
            self.state[bytes(k)] = (version, value)

    async def _sync(self) -> list:
        """Read to the durable end as of now; returns the tail's token."""
        if time.monotonic() - self._synced > REREAD_AFTER:
            self.state.clear()
            await self.log.reread()
            self.reader = self.log.reader
        token = await self.log.sync(self._apply)
        self._synced = time.monotonic()
        return token

    async def _write(self, key: bytes, decide):
        """``decide(current)`` -> (record value, or None to change nothing; the caller's
        result); appended only if the log's end is still the state it decided on."""
        async with self._lock:
            while True:
                token = await self._sync()
                record, result = decide(self.state.get(key))
                if record is None:
                    return result
                if await self.log.append("append_if", {"expect": token}, [record], [key]):
                    return result

    async def _read(self) -> dict:
        async with self._lock:
            if self.reads == "linearizable":
                await self._sync()
            return self.state

    async def get(self, key) -> bytes | None:
        v = (await self._read()).get(_key(key))
        return None if v is None else v[1]

    async def get_versioned(self, key) -> tuple[int, bytes] | None:
        """(version, value), or None when absent."""
        return (await self._read()).get(_key(key))

    async def items(self) -> list[tuple[bytes, int, bytes]]:
        """(key, version, value) of every key, sorted by key."""
        return sorted((k, ver, v) for k, (ver, v) in (await self._read()).items())

    async def put(self, key, value) -> int:
        """Set ``key``; returns its new version."""
        return await self._write(_key(key), _Put(_val(value)))

    async def put_if_absent(self, key, value) -> bool:
        return await self._write(_key(key), _Put(_val(value), only_if_absent=True))

    async def compare_and_set(self, key, expected_version: int, value) -> bool:
        """Set ``key`` only if its version is ``expected_version`` (0: absent)."""
        return await self._write(_key(key), _Put(_val(value), expected=expected_version))

    async def delete(self, key) -> bool:
        """Remove ``key``; False if it was absent."""
        return await self._write(_key(key), _delete)


def _val(v) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class _Put:
    """A put's decision on the current (version, value): the record to append, or None."""

    def __init__(self, value: bytes, expected: int | None = None, only_if_absent: bool = False):
        self.value, self.expected, self.only_if_absent = value, expected, only_if_absent

    def __call__(self, cur):
        version = cur[0] if cur else 0
        if self.only_if_absent and cur is not None or \
                self.expected is not None and self.expected != version:
            return None, False
        record = msgpack.packb([version + 1, self.value])
        return record, (version + 1 if self.expected is None and not self.only_if_absent else True)


def _delete(cur):
    return (b"", True) if cur is not None else (None, False)


@asynccontextmanager
async def open_kv(name: str, coordinator: str | None = None, create: bool = True,
                  config: dict | None = None, **kw):
    """``async with open_kv("config") as m: await m.put("k", "v")``; ``config``: the
    security settings (``kera.security.client_config``; default ``KERA_CONFIG``). A map on
    stream S takes S's rights: read for reads, write for writes, create to make it."""
    async with unwrapped(), open_pool(credentials=credentials(config)) as pool:
        m = AsyncKVMap(pool, coordinator or default_coordinator(), name, **kw)
        await m.open(create)
        yield m


class KVMap(Synced):
    """Synchronous map: ``KVMap("config").put("k", "v")``; the same operations as AsyncKVMap."""

    def __init__(self, name: str, coordinator: str | None = None, create: bool = True,
                 config: dict | None = None, **kw):
        super().__init__("kera-kv", open_kv, name, coordinator, create, config, **kw)
