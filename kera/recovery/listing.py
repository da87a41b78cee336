"""Asking the backups what they hold of a dead broker (``list``, the closed intact copies as
columns): what a recovery plans its replay from, and an adoption after a hand-over too."""

from __future__ import annotations

import trio

from .plan import Listing


async def list_backups(pool, backups: list, broker: int) -> tuple[dict[int, Listing], dict[int, int]]:
    """What ``backups`` hold of ``broker``'s vlogs (``list``, all at once, the closed intact
    copies as columns): backup id -> its copies, and vlog -> its floor (vsegs below were
    released by the broker: retention). One that does not answer fails the caller: it may
    hold the only intact copy."""
    listings: dict[int, Listing] = {}
    floors: dict[int, int] = {}

    async def listing(b) -> None:
        r, payload = await pool.call(b.addr, "list", {"broker": broker, "columns": True}, timeout=10)
        listings[b.id] = Listing.of(r, payload)
        for _, vlog, floor in r.get("floors") or []:
            floors[vlog] = max(floors.get(vlog, 0), floor)

    async with trio.open_nursery() as n:
        for b in backups:
            n.start_soon(listing, b)
    return listings, floors
