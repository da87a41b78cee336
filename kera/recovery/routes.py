"""A replay's routes: which broker incarnation rebuilds each streamlet, packed as rows.

The recovery manager packs them (``pack_routes``), a backup's replay parses them
(``parse_routes``). They travel in the replay request's payload, one ``ROUTE`` row per
streamlet with its owner an index into the meta's ``owners``: a broker holding 333,334
streamlets (a million streams on three nodes) made 8 MB of routes as a map, over
``MAX_META``.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

ROUTE = np.dtype([("stream", "<u8"), ("streamlet", "<u4"), ("owner", "<u4")])


def pack_routes(routes) -> tuple[list, bytes]:
    """``[(stream_id, streamlet, addr, epoch), ...]`` as a replay request carries them: the
    owners ``[[addr, epoch], ...]`` (its meta) and a ``ROUTE`` row per streamlet (its payload)."""
    owners: dict[tuple[str, int], int] = {}
    rows = np.empty(len(routes), ROUTE)
    if len(routes):   # column by column: a row at a time cost a third of a second per 333,334
        sids, sls, addrs, epochs = zip(*routes, strict=True)
        rows["stream"], rows["streamlet"] = sids, sls
        rows["owner"] = [owners.setdefault(o, len(owners)) for o in zip(addrs, epochs, strict=True)]
    return [list(o) for o in owners], rows.tobytes()


def parse_routes(owners, payload) -> dict[tuple[int, int], tuple[str, int]]:
    """``pack_routes``'s owners and rows, as ``{(stream_id, streamlet): (addr, epoch)}``."""
    try:
        targets = [(str(addr), int(epoch)) for addr, epoch in owners]
    except (TypeError, ValueError):
        raise InvalidArgument("owners must be [[addr, epoch], ...]") from None
    data = bytes(payload) if not isinstance(payload, list) else b"".join(payload)
    if len(data) % ROUTE.itemsize:
        raise InvalidArgument(f"routes: {len(data)} bytes are not rows of {ROUTE.itemsize}")
    rows = np.frombuffer(data, ROUTE)
    if len(rows) and int(rows["owner"].max()) >= len(targets):
        raise InvalidArgument("routes: an owner index beyond owners")
    return dict(zip(zip(rows["stream"].tolist(), rows["streamlet"].tolist(), strict=True),
                    map(targets.__getitem__, rows["owner"].tolist()), strict=True))
