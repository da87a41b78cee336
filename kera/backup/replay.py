"""Replay: a backup pushes one replica's chunks to the brokers recovering them.

The recovery manager names, per streamlet, the broker rebuilding it. The
backup reads the replica in bounded pieces (verified chunks only), routes
each chunk by its header's (stream, streamlet), and sends each broker its
chunks in vlog order with ``recover`` requests, brokers in parallel. Chunks
of streamlets nobody recovers (deleted streams) are skipped.
"""

from __future__ import annotations

import trio

from .. import chunk as chunkfmt
from ..errors import InvalidArgument
from ..limits import REPLAY_READ

READ_BYTES = REPLAY_READ
RECOVER_TIMEOUT = 120.0


def parse_routes(routes) -> dict[tuple[int, int], tuple[str, int]]:
    try:
        return {(int(sid), int(i)): (str(addr), int(epoch)) for sid, i, addr, epoch in routes}
    except (TypeError, ValueError):
        raise InvalidArgument("routes must be [[stream_id, streamlet, addr, epoch], ...]") from None


async def replay(read, pool, routes: dict, length: int) -> dict:
    """``read(offset, max_bytes)`` -> (meta, data) of whole verified chunks."""
    offset = chunks = nbytes = skipped = 0
    while offset < length:
        meta, data = await read(offset, READ_BYTES)
        if isinstance(data, list):
            data = b"".join(data)
        data = memoryview(data)
        per_target: dict[tuple[str, int], list] = {}
        for h, o in chunkfmt.scan(data):
            target = routes.get((h.stream_id, h.streamlet))
            if target is None:
                skipped += 1
                continue
            per_target.setdefault(target, []).append(data[o:o + h.size])
            chunks += 1
            nbytes += h.size

        async def send(addr, epoch, parts):
            await pool.call(addr, "recover", {"epoch": epoch}, parts=parts, timeout=RECOVER_TIMEOUT)

        async with trio.open_nursery() as n:
            for (addr, epoch), parts in per_target.items():
                n.start_soon(send, addr, epoch, parts)
        nxt = meta["next"]
        if nxt <= offset:
            break
        offset = nxt
    return {"chunks": chunks, "bytes": nbytes, "skipped": skipped}
