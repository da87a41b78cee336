"""Where streams live, however many: the coordinator's ``metadata`` answers a page at a time.

Every client that needs many streams' metadata (the producer's lookups and
``load_metadata``, a consumer's streams or pattern, the admin's listings, the
Spark source's planning) asks through ``fetch`` (or ``pages``, a pattern's
pages in order): names go at most ``MAX_LIST_PAGE`` per request, a few
requests at once (the coordinator answers one while this process reads
another), and each answer, bounded in streams and streamlets by the
coordinator, says which names did not fit (``more``) and where a pattern's
listing goes on (``next``). So no answer outgrows a frame whatever the number
of streams, and one request serves up to a page of streams, never one stream.
A name the caller may not describe is answered on its own (``refused``), as
Kafka answers TOPIC_AUTHORIZATION_FAILED per topic: the other names of its
page are answered as usual.

A pattern is listed in name order, or, with ``since`` (a stream id), only
the streams created after it: a subscription learns its new streams without
listing every old one again (``top`` of an answer is where the next
``since`` may start).

Pages are asked as columns (``kera.meta_columns``): a page is a few arrays, not a
map per stream, and callers that keep many streams (the producer, the consumer)
read the columns; ``describe`` makes a ``StreamView`` of each. A coordinator too
old to know columns refuses the field: the page is asked again as maps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import trio

from kera import meta_columns
from kera.errors import InvalidArgument, Unauthorized, UnknownStream
from kera.limits import MAX_LIST_PAGE
from kera.meta_columns import Columns
from kera.rpc import unwrapped

from .bulk import bulk, settled
from .stream_view import StreamView

PARALLEL = 4   # pages of names asked at once


async def _ask(coordinator, meta: dict, timeout: float) -> tuple[dict, Columns]:
    """One page: the answer and its streams as columns."""
    try:
        r, _ = await coordinator.call("metadata", {**meta, "columns": True}, timeout=timeout)
    except InvalidArgument as e:
        if "columns" not in str(e):
            raise
        r, _ = await coordinator.call("metadata", meta, timeout=timeout)   # an older coordinator
    if "columns" in r:
        return r, meta_columns.decode(r["columns"])
    return r, meta_columns.from_views([StreamView.from_wire(d) for d in r["streams"]])


async def pages(coordinator, pattern: str, *, since: int | None = None, timeout: float = 30.0,
                limit: int | None = None, tops: list | None = None) -> AsyncIterator[Columns]:
    """The streams matching ``pattern``, a page per request: in name order, or those created
    after stream id ``since`` in id order. ``tops``: each answer's ``top`` is appended."""
    cursor = None
    while True:
        meta = {"pattern": pattern}
        if since is not None:
            meta["since"] = since if cursor is None else cursor
        elif cursor is not None:
            meta["after"] = cursor
        if limit is not None:
            meta["limit"] = limit
        r, cols = await _ask(coordinator, meta, timeout)
        if tops is not None and "top" in r:
            tops.append(r["top"])
        yield cols
        cursor = r.get("next")
        if cursor is None:
            return


async def listed(coordinator, pattern: str, on_page: Callable[[Columns], Awaitable[None]], *,
                 since: int | None = None, timeout: float = 30.0, tops: list | None = None) -> None:
    """``await on_page(columns)`` for every page of ``pages``, the next page asked for while
    this one is taken in (a million streams' listing and what the caller makes of it overlap,
    rather than adding up)."""
    send, receive = trio.open_memory_channel(1)

    async def pager() -> None:
        async with send:
            async for cols in pages(coordinator, pattern, since=since, timeout=timeout, tops=tops):
                await send.send(cols)

    async with unwrapped(), trio.open_nursery() as n:   # the pager's error, as it was raised
        n.start_soon(pager)
        async with receive:
            async for cols in receive:
                await on_page(cols)


async def fetch(coordinator, names: Iterable[str] = (), pattern: str | None = None,
                on_page: Callable[[Columns, list, list], None] | None = None, *,
                since: int | None = None, timeout: float = 30.0) -> int | None:
    """``on_page(columns, missing, refused)`` for every answer: the streams ``names`` (the
    unknown ones in ``missing``, those the caller may not describe in ``refused``; pages of
    names in any order), then those matching ``pattern`` (created after ``since`` if given;
    the named ones may come again). Returns the lowest ``top`` of the answers (streams
    created since have higher ids), None from an older coordinator."""
    names = list(names)
    tops: list = []
    limiter = trio.CapacityLimiter(PARALLEL)

    async def part(ask: list) -> None:
        async with limiter:
            while ask:
                r, cols = await _ask(coordinator, {"names": ask}, timeout)
                if "top" in r:
                    tops.append(r["top"])
                on_page(cols, r.get("missing") or [], r.get("refused") or [])
                more = r.get("more") or 0
                ask = ask[len(ask) - more:] if more else []

    if names:
        async with unwrapped(), trio.open_nursery() as n:   # a refusal, not a group holding it
            for i in range(0, len(names), MAX_LIST_PAGE):
                n.start_soon(part, names[i:i + MAX_LIST_PAGE])
    if pattern is not None:
        async def take(cols) -> None:
            on_page(cols, [], [])

        await listed(coordinator, pattern, take, since=since, timeout=timeout, tops=tops)
    return min(tops) if tops else None


async def describe(coordinator, names: Iterable[str] = (), pattern: str | None = None, *,
                   timeout: float = 30.0, strict: bool = True, tops: list | None = None) -> dict[str, StreamView]:
    """``{name: StreamView}`` of ``fetch``'s answers (the named streams in their order), once
    every page is read: names the caller may not describe raise ``Unauthorized`` (its
    ``refused`` lists them); with ``strict``, unknown names raise ``UnknownStream`` (its
    ``missing`` lists them). ``tops``: what ``fetch`` returns is appended."""
    out: dict[str, StreamView] = {}
    missing: list = []
    refused: list = []

    def take(cols, gone, denied):
        with bulk():
            for s in cols.views(StreamView):
                out[s.name] = s
        settled(len(cols.names))
        missing.extend(gone)
        refused.extend(denied)

    names = list(names)
    top = await fetch(coordinator, names, pattern, take, timeout=timeout)
    if names:   # the named ones in their order (their pages came in any), then the pattern's
        out = {**{n: out[n] for n in names if n in out}, **out}
    if tops is not None:
        tops.append(top)
    if refused:
        raise refusal(refused)
    if missing and strict:
        raise unknown(missing)
    return out


def _shown(names: list) -> str:
    return ", ".join(map(str, names[:10])) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


def unknown(missing: list) -> UnknownStream:
    """The error for streams that do not exist (``missing`` names them all)."""
    e = UnknownStream(f"unknown streams: {_shown(missing)}")
    e.missing = missing
    return e


def refusal(refused: list) -> Unauthorized:
    """The error for streams the caller may not describe (``refused`` names them all)."""
    e = Unauthorized(f"not authorized to describe streams: {_shown(refused)}")
    e.refused = refused
    return e
