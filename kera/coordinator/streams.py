"""The streams' admin: create, alter, delete, describe and list streams, and say where they live.

Every change is recorded in the term's metadata (``kera.coordinator.metadata``) and made
durable before it is answered or told to the brokers; a batch of creates is checked whole
before anything is recorded, with no await in between, so a refused batch leaves no trace.
A stream's spec is checked by ``kera.coordinator.specs``; its streamlets are placed by
``kera.coordinator.placement``. Every answer fits a frame, however many streams are asked
for: listings and lookups come a page at a time (``kera.coordinator.catalog``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from .. import group_positions, limits, meta_columns
from ..errors import (
    InvalidArgument,
    InvalidName,
    KeraError,
    LimitExceeded,
    NotEnoughBackups,
    UnknownStream,
)
from ..names import is_internal
from ..stream_meta import StreamMeta
from . import specs
from .catalog import Page
from .membership import Roster
from .metadata import Metadata
from .placement import Placement

log = logging.getLogger("kera.coordinator")


def _describes(peer):
    """Whether ``peer`` may describe a stream of this name: a listing's filter."""
    return lambda name: peer.may("describe", "stream", name)


class StreamAdmin:
    """The streams of the term's ``metadata``, owned by the ``roster``'s brokers as
    ``placement`` spreads them; ``pool()``: the coordinator's pool; ``retention_defaults``:
    the cluster's (``--retention-bytes``, ``--retention-ms``)."""

    def __init__(self, metadata: Metadata, roster: Roster, placement: Placement, pool: Callable,
                 retention_defaults: dict):
        self.metadata, self.roster, self.placement, self.pool = metadata, roster, placement, pool
        self.streams = metadata.streams
        self.retention_defaults = retention_defaults
        self._creating = trio.Lock()   # an internal stream, on first use

    # -- describing -------------------------------------------------------------------
    def describe(self, s: StreamMeta) -> dict:
        """A stream with the address of each streamlet's owner (None while it is recovered)."""
        return self.addressed(self.metadata.wire(s))

    def addressed(self, d: dict) -> dict:
        """Stream map ``d`` (the caller's), with ``addrs``: each streamlet's owner's address."""
        addrs = []
        for b, e in d["owners"]:
            m = self.roster.live_broker(b, e)
            addrs.append(m.addr if m is not None else None)
        d["addrs"] = addrs
        return d

    def stream(self, name) -> StreamMeta:
        s = self.streams.get(name) if isinstance(name, str) else None
        if s is None:
            raise UnknownStream(f"no stream named {name!r}")
        return s

    def _user_stream(self, name) -> StreamMeta:
        """A stream a user may change: internal ones are kera's."""
        s = self.stream(name)
        if is_internal(name):
            raise InvalidName(f"stream {name!r} is internal: it cannot be deleted or altered")
        return s

    # -- creating ---------------------------------------------------------------------
    async def create_stream(self, meta) -> dict:
        """One stream: the batch path with one entry."""
        s, = await self.create([meta])
        return {"stream": self.describe(s)}

    async def create_streams(self, meta, peer) -> dict:
        """Many streams in one request, all or none: ``{"streams": [spec, ...]}``, each spec
        shaped like ``create_stream``'s request. Answers their ids, in order. A client must
        be allowed to create every one of them (else none is)."""
        specs_ = meta["streams"]
        for i, spec in enumerate(specs_):
            if isinstance(spec.get("name"), str) and not peer.may("create", "stream", spec["name"]):
                try:
                    peer.require("create", "stream", spec["name"])
                except KeraError as e:
                    e.index, e.stream = i, spec["name"]
                    raise
        return {"ids": [s.id for s in await self.create(specs_)]}

    def _checked(self, specs_: list, internal: bool) -> dict[str, dict]:
        """Every spec checked (name -> its shape), or the first refusal, which carries
        ``index`` and ``stream`` (the entry's name) and, in a batch of several, says which
        entry it is."""
        nodes = len(self.roster.nodes())
        checked: dict[str, dict] = {}
        for i, spec in enumerate(specs_):
            try:
                name, cfg = specs.config(spec, nodes, self.retention_defaults,
                                         self.streams.__contains__, internal)
                if name in checked:
                    raise InvalidArgument(f"stream {name!r} is named twice in the batch")
            except KeraError as e:
                e.index = i
                if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                    e.stream = spec["name"]
                if len(specs_) > 1:
                    e.args = (f"streams[{i}]: {e}",)
                raise
            checked[name] = cfg
        total = sum(cfg["streamlets"] for cfg in checked.values())
        if total > limits.MAX_BATCH_STREAMLETS:
            raise LimitExceeded(f"{total} streamlets in one batch exceed MAX_BATCH_STREAMLETS "
                                f"({limits.MAX_BATCH_STREAMLETS})", limit="MAX_BATCH_STREAMLETS",
                                bound=limits.MAX_BATCH_STREAMLETS, size=total)
        return checked

    async def create(self, specs_: list, internal: bool = False) -> list[StreamMeta]:
        """Create all of ``specs_`` or none of them, with one commit and one assign per broker.
        ``internal``: kera's own streams (not listed, named as no user's may be)."""
        await self.roster.wait_ready()
        if not self.roster.live("broker"):
            raise NotEnoughBackups("no live broker to place the stream on")
        checked = self._checked(specs_, internal)
        created = []
        now = time.time()
        loads = self.placement.loads()
        for name, cfg in checked.items():
            sid = self.metadata.take("next_stream_id")
            owners = tuple([(m.id, m.epoch) for m in self.placement.spread(cfg["streamlets"], sid, loads)])
            s = StreamMeta(name=name, id=sid, **cfg, owners=owners, created=now)
            self.streams.create(s, listed=not internal)
            created.append(s)
        await self.metadata.commit()
        await self.placement.assign_owners(created)
        total = sum(s.streamlets for s in created)
        if len(created) == 1:
            log.info("created stream %s (id %d, %d streamlets)", created[0].name, created[0].id, total)
        else:
            log.info("created %d streams (ids %d-%d, %d streamlets)", len(created), created[0].id,
                     created[-1].id, total)
        return created

    async def positions_stream(self) -> dict:
        """The internal stream consumer groups commit their positions to, created on first
        use (``kera.group_positions``): the coordinator never sees a commit."""
        async with self._creating:
            s = self.streams.get(group_positions.NAME)
            if s is None:
                s, = await self.create([{"name": group_positions.NAME, **group_positions.SHAPE}],
                                       internal=True)
        return {"stream": self.describe(s)}

    # -- listing ----------------------------------------------------------------------
    def list_streams(self, meta, peer) -> dict:
        """One page of the streams matching ``pattern`` (all if None) that the caller may
        describe, in name order, from just after ``after``: at most ``limit`` (``MAX_LIST_PAGE``) streams and
        ``MAX_LIST_PAGE_STREAMLETS`` streamlets. ``next`` is the ``after`` of the next page,
        None once the listing is complete (a page may be empty and still have a next)."""
        pattern, after = meta.get("pattern"), meta.get("after")
        page = Page(meta.get("limit") or limits.MAX_LIST_PAGE)
        nxt = self.streams.listing(page, self.addressed, pattern, after, visible=_describes(peer))
        return {"streams": page.streams, "next": nxt}

    def locate(self, meta, peer) -> dict:
        """Where streams live, a page (as ``list_streams``'s) at a time: the streams ``names``
        (at most ``MAX_LIST_PAGE``; the unknown ones in ``missing``), then those matching
        ``pattern``: from just after ``after`` in name order or, with ``since`` (a stream id),
        those created after it, in id order (a subscription's new streams: what was created
        since, not every name again). ``more``: how many names (the last ones) did not fit,
        to ask again; the pattern is begun only once every name is answered, and ``next`` is
        the ``after`` (or ``since``) of its next page (None once complete, or with no
        pattern). Only the streams the caller may describe are answered: a name it may not
        is in ``refused``, whether it exists or not, and the others are answered (Kafka's
        TOPIC_AUTHORIZATION_FAILED for that topic alone). ``top``: the newest stream id, where
        a later ``since`` may start. Every answer fits a frame, however many streams are asked
        for (``kera_client.metadata``)."""
        names = meta.get("names") or []
        pattern, after, since = meta.get("pattern"), meta.get("after"), meta.get("since")
        visible = _describes(peer)
        page = Page(meta.get("limit") or limits.MAX_LIST_PAGE)
        # ``columns``: the page as ``kera.meta_columns`` (rows, addressed there), not maps
        columns = bool(meta.get("columns"))
        out = {"streams": page.streams, "missing": [], "refused": [], "more": 0, "next": None,
               "top": self.metadata.state["next_stream_id"] - 1,
               "kafka": {m.id: m.kafka for m in self.roster.live("broker") if m.kafka}}
        for k, (name, e) in enumerate(zip(names, self.streams.entries(names, columns, self.addressed),
                                          strict=True)):
            if not visible(name):
                out["refused"].append(name)
                continue
            if e is None:
                out["missing"].append(name)
            elif page.fits(e[1]):
                page.add(*e)
            else:
                out["more"] = len(names) - k
                out["next"] = (after if since is None else since) if pattern else None
                return self._columns(out, columns)
        if pattern and since is not None:
            out["next"] = self.streams.created(page, self.addressed, pattern, since, visible, columns)
        elif pattern:
            out["next"] = self.streams.listing(page, self.addressed, pattern, after,
                                               skip=set(names), visible=visible, columns=columns)
        return self._columns(out, columns)

    def _columns(self, out: dict, columns: bool) -> dict:
        """A metadata answer's streams as columns (its page holds (name, row, rare) each), if
        they were asked so."""
        if columns:
            entries = out.pop("streams")
            out["columns"] = meta_columns.encode_rows(
                [e[0] for e in entries], [e[1] for e in entries],
                {i: e[2] for i, e in enumerate(entries) if e[2]}, self._live_addr)
        return out

    def _live_addr(self, broker: int, epoch: int) -> str | None:
        m = self.roster.live_broker(broker, epoch)
        return m.addr if m is not None else None

    # -- changing ---------------------------------------------------------------------
    async def _tell_owners(self, owners, method: str, meta: Callable) -> None:
        """``method`` with ``meta(member)`` to each live owner in ``owners``, all at once; one
        that fails gets the stream again with its next assign."""
        async def one(bid, epoch):
            m = self.roster.live_broker(bid, epoch)
            if m is not None:
                try:
                    await self.pool().call(m.addr, method, meta(m), timeout=10)
                except KeraError as e:
                    log.warning("%s on broker %d failed: %s", method, bid, e)

        async with trio.open_nursery() as n:
            for bid, epoch in set(owners):
                n.start_soon(one, bid, epoch)

    async def delete_stream(self, meta) -> dict:
        s = self._user_stream(meta.get("name"))
        owners = await self.metadata.delete_stream(s)
        await self._tell_owners(owners, "unassign", lambda m: {"epoch": m.epoch, "stream_id": s.id})
        return {"deleted": s.name}

    async def alter_stream(self, meta) -> dict:
        """Change a stream's retention (``retention_bytes`` / ``retention_ms``) or compaction
        (``cleanup_policy``, ``delete_retention_ms``, ``segment_ms``), or Kafka's dotted names:
        persisted, then pushed to the brokers owning its streamlets, which apply it at their
        next pass. Refused as a whole if any value is invalid."""
        s = self._user_stream(meta.get("name"))
        changes = {**specs.retention(meta), **specs.cleanup_policy(meta, s.groups)}
        if not changes:
            raise InvalidArgument("alter_stream needs retention_bytes, retention_ms, cleanup_policy, "
                                  "delete_retention_ms and/or segment_ms")
        altered = self.streams.alter(s, changes)
        await self.metadata.commit()
        s = self.metadata.now(altered)   # moved meanwhile: its owners now
        await self._tell_owners(s.owners, "configure",
                                lambda m: {"epoch": m.epoch, "stream": self.metadata.wire(s)})
        log.info("stream %s: %s", s.name, changes)
        return {"stream": self.describe(s)}
