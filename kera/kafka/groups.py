"""Consumer groups (placeholder while the core is brought up)."""

from __future__ import annotations

import trio


class Coordinator:
    def __init__(self, gw):
        self.gw = gw

    async def run(self) -> None:
        await trio.sleep_forever()


def handlers(gw) -> dict:
    return {}
