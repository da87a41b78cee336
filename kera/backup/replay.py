"""Replay: a backup pushes one replica's chunks to the brokers recovering them.

The recovery manager names, per streamlet, the broker rebuilding it, and the
offset to start from. The backup reads the replica in bounded pieces
(verified chunks only), routes each chunk by its header's (stream,
streamlet), and sends each broker its chunks in vlog order with ``recover``
requests, brokers in parallel. Chunks of streamlets nobody recovers (deleted
streams) are skipped.

A step stops at the first chunk it cannot deliver and says where, so that the
coordinator continues from another copy at that very offset:

- ``end``: the copy has nothing more;
- ``corrupt``: the next chunk is corrupt (known from the index, or found when
  read back from the file); never skipped, since the chunks after it in the
  same groups could not be placed without it;
- ``refused``: a new owner refused the chunk (``DataLoss``: a hole before it).

Any other error of a new owner is raised again with its ``target`` address
set: the coordinator then plans the recovery again (the copy is not at fault).

The routes travel in the request's payload, packed (``kera.recovery.manager.routes``: a row
per streamlet, its owner an index into the meta's ``owners``), not
in its meta: a broker holding 333,334 streamlets (a million streams on three
nodes) made 8 MB of routes, over ``MAX_META``, and every step of its recovery
failed as if each copy were lost.
"""

from __future__ import annotations

import trio

from .. import chunk as chunkfmt
from ..errors import DataLoss, KeraError
from ..limits import REPLAY_READ

RECOVER_TIMEOUT = 120.0

END, CORRUPT, REFUSED = "end", "corrupt", "refused"


async def replay(read, pool, routes: dict, offset: int, length: int, replay_from=None) -> dict:
    """Replay from ``offset`` until the copy's end or its first undeliverable chunk.

    ``read(offset, max_bytes)`` -> (meta, data) of whole verified chunks, as
    the backup's ``read`` answers (``corrupt_at`` when it stopped before a
    corrupt region, ``next`` past it).
    """
    out = {"chunks": 0, "bytes": 0, "skipped": 0}
    while offset < length:
        meta, data = await read(offset, REPLAY_READ)
        if isinstance(data, list):
            data = b"".join(data)
        data = memoryview(data)
        per_target: dict[tuple[str, int], tuple[list, list[int]]] = {}
        for h, o in chunkfmt.scan(data):
            target = routes.get((h.stream_id, h.streamlet))
            if target is None or (replay_from and h.segment < replay_from.get(
                    (h.stream_id, h.streamlet, h.group), -1)):
                out["skipped"] += 1
                continue
            parts, offsets = per_target.setdefault(target, ([], []))
            parts.append(data[o:o + h.size])
            offsets.append(offset + o)
        refused = await _send(pool, per_target, out)
        if refused is not None:
            off, err = refused
            return {**out, "next": off, "stopped": REFUSED, "error": str(err)}
        corrupt_at = meta.get("corrupt_at")
        if corrupt_at is not None:
            return {**out, "next": corrupt_at, "stopped": CORRUPT, "corrupt_end": meta["next"]}
        nxt = meta["next"]
        if nxt <= offset:
            break
        offset = nxt
    return {**out, "next": offset, "stopped": END}


async def _send(pool, per_target: dict, out: dict):
    """One ``recover`` request per broker, in parallel; (offset, error) of the first refused chunk."""
    refused: list[tuple[int, DataLoss]] = []
    failed: list[KeraError] = []

    async def one(addr, epoch, parts, offsets):
        try:
            await pool.call(addr, "recover", {"epoch": epoch}, parts=parts, timeout=RECOVER_TIMEOUT)
        except DataLoss as e:
            i = getattr(e, "index", 0)
            i = i if isinstance(i, int) and 0 <= i < len(offsets) else 0
            refused.append((offsets[i], e))
            parts = parts[:i]
        except KeraError as e:
            e.target = addr
            failed.append(e)
            return
        out["chunks"] += len(parts)
        out["bytes"] += sum(p.nbytes for p in parts)

    async with trio.open_nursery() as n:
        for (addr, epoch), (parts, offsets) in per_target.items():
            n.start_soon(one, addr, epoch, parts, offsets)
    if failed:
        raise failed[0]
    return min(refused, key=lambda r: r[0]) if refused else None
