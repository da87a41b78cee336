"""Admin operations against the coordinator."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

from kera import limits
from kera.coordinator.link import CoordinatorLink
from kera.errors import KeraError
from kera.rpc import open_pool
from kera.security.acl import Acl
from kera.security.client_config import credentials
from kera.security.mechanisms import credentials as scram_credentials

from .metadata import describe, pages
from .portal import Synced
from .stream_view import StreamView

DEFAULT_COORDINATOR = "127.0.0.1:7700"


def default_coordinator() -> str:
    return os.environ.get("KERA_COORDINATOR", DEFAULT_COORDINATOR)


async def suspect(coordinator: CoordinatorLink, addr: str) -> None:
    """Tell the coordinator a broker did not answer, so it checks now, not at the next timeout."""
    try:
        await coordinator.call("suspect", {"addr": addr}, timeout=5)
    except KeraError:
        pass


class AsyncAdmin:
    def __init__(self, pool, coordinator: str | None = None, timeout: float = 30.0):
        self.pool = pool
        self.coordinator = CoordinatorLink(pool, coordinator or default_coordinator())
        self.timeout = timeout

    async def call(self, method: str, **meta):
        r, _ = await self.coordinator.call(method, meta, timeout=self.timeout)
        return r

    async def create_stream(self, name: str, streamlets: int | None = None, groups: int | None = None,
                            replication: int | None = None, vlogs: str | None = None, **extra) -> StreamView:
        r = await self.call("create_stream", name=name, streamlets=streamlets, groups=groups,
                            replication=replication, vlogs=vlogs, **extra)
        return StreamView.from_wire(r["stream"])

    async def create_streams(self, streams: list, **defaults) -> list[dict]:
        """Many streams, each a name or a spec like ``create_stream``'s arguments
        (``{"name": ..., "streamlets": ...}``); ``defaults`` fill what a spec leaves out.

        Sent in requests of at most ``MAX_BATCH_STREAMS`` streams (and
        ``MAX_BATCH_STREAMLETS`` streamlets): each request creates all of its
        streams or none, and a refused one (the error's ``index`` is the entry's
        position in that request, ``stream`` its name) stops here, with the earlier
        requests' streams kept. Returns ``{"name", "id"}`` of each, in order.
        """
        specs = []
        for s in streams:
            spec = {"name": s} if isinstance(s, str) else dict(s)
            for k, v in defaults.items():
                spec.setdefault(k, v)
            specs.append({k: v for k, v in spec.items() if v is not None})
        out: list[dict] = []
        batch: list[dict] = []
        streamlets = 0

        async def send():
            r = await self.call("create_streams", streams=batch)
            out.extend({"name": s["name"], "id": i} for s, i in zip(batch, r["ids"], strict=True))

        for spec in specs:
            n = spec.get("streamlets")
            n = n if isinstance(n, int) and n > 0 else 1
            if batch and (len(batch) == limits.MAX_BATCH_STREAMS or streamlets + n > limits.MAX_BATCH_STREAMLETS):
                await send()
                batch, streamlets = [], 0
            batch.append(spec)
            streamlets += n
        if batch:
            await send()
        return out

    async def alter_stream(self, name: str, retention_bytes: int | None = None,
                           retention_ms: int | None = None, **settings) -> StreamView:
        """Change a stream's retention (Kafka's retention.bytes / retention.ms; -1 unbounded)
        or compaction (``cleanup_policy``, ``delete_retention_ms``, ``segment_ms``)."""
        extra = {k: v for k, v in (("retention_bytes", retention_bytes),
                                   ("retention_ms", retention_ms), *settings.items()) if v is not None}
        return StreamView.from_wire((await self.call("alter_stream", name=name, **extra))["stream"])

    async def list_streams(self, pattern: str | None = None) -> list[StreamView]:
        """Every stream matching ``pattern`` (fnmatch; all if None), in name order."""
        return [s async for s in self.iter_streams(pattern)]

    async def iter_streams(self, pattern: str | None = None, page: int | None = None):
        """The same, a page (``page`` streams, at most ``MAX_LIST_PAGE``) per request, so a
        caller can show the first ones before the last are fetched."""
        async for cols in pages(self.coordinator, pattern or "*", timeout=self.timeout, limit=page):
            for s in cols.views(StreamView):
                yield s

    async def describe_stream(self, name: str) -> StreamView:
        return StreamView.from_wire((await self.call("describe_stream", name=name))["stream"])

    async def describe_streams(self, names) -> dict[str, StreamView]:
        """Many streams by name, a page per request: ``{name: StreamView}``; UnknownStream
        (its ``missing`` lists them) if some do not exist."""
        return await describe(self.coordinator, names, timeout=self.timeout)

    async def delete_stream(self, name: str) -> None:
        await self.call("delete_stream", name=name)

    async def status(self) -> dict:
        return await self.call("status")

    # -- users and ACLs (with --auth) -------------------------------------------------
    async def add_user(self, name: str, password: str) -> None:
        """Add a user or change its password: only salted keys leave this process."""
        await self.call("user_add", name=name, credentials=scram_credentials(password))

    async def delete_user(self, name: str) -> None:
        await self.call("user_delete", name=name)

    async def users(self) -> list[tuple[str, list[str]]]:
        """(name, mechanisms) of every user."""
        return [tuple(u) for u in (await self.call("user_list"))["users"]]

    async def add_acl(self, acl: Acl) -> bool:
        """True if it was not there yet."""
        return bool((await self.call("acl_add", acl=acl.to_wire()))["added"])

    async def remove_acl(self, acl: Acl) -> bool:
        return bool((await self.call("acl_remove", acl=acl.to_wire()))["removed"])

    async def acls(self, principal: str | None = None) -> list[Acl]:
        return [Acl(*a) for a in (await self.call("acl_list", principal=principal))["acls"]]

    async def broker_stats(self, streams: bool = False, status: dict | None = None) -> list[dict]:
        """Every live broker's own counters (chunks, bytes, memory, evictions, per-vlog
        replication; with ``streams``, retained bytes and start per stream), asked of the
        brokers themselves; one that does not answer is left out."""
        return await self._member_stats("brokers", {"streams": streams}, status)

    async def backup_stats(self, status: dict | None = None) -> list[dict]:
        """Every live backup's own counters (disk used, reclaimed, reads)."""
        return await self._member_stats("backups", {}, status)

    async def _member_stats(self, role: str, meta: dict, status: dict | None) -> list[dict]:
        out = []
        for b in (status or await self.status())[role]:
            if b["alive"]:
                try:
                    r, _ = await self.pool.call(b["addr"], "stats", meta, timeout=self.timeout)
                except KeraError:
                    continue
                out.append(r)
        return out


@asynccontextmanager
async def open_admin(coordinator: str | None = None, config: dict | None = None):
    """``config``: the client's security settings, by Kafka's names
    (``kera.security.client_config``; default: the ``KERA_CONFIG`` file, if set)."""
    async with open_pool(credentials=credentials(config)) as pool:
        yield AsyncAdmin(pool, coordinator)


class Admin(Synced):
    """Synchronous admin client: ``Admin().create_stream("s", streamlets=4)``."""

    def __init__(self, coordinator: str | None = None, config: dict | None = None):
        super().__init__("kera-admin", open_admin, coordinator, config)
