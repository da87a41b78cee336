"""A listener's door: what one server lets connections hold.

Caps on open connections (in all, and from one peer address); deadlines (a connection
idle for ``idle_timeout``, a frame begun and not whole within ``frame_timeout``, a
connection that must authenticate and has not within ``handshake_timeout``, a reply the
peer has not taken within ``send_timeout``); a byte budget of replies queued per
connection; and a budget, over all connections, of the bytes of large frames still
arriving (past it they wait for room, their frame deadline running on), so that many
half-sent frames cost a bounded amount of memory. Each refusal is typed
(``ConnectionLimit``, ``PeerTooSlow``) and counted in ``stats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import trio

from . import limits
from .errors import ConnectionLimit


@dataclass
class DoorLimits:
    max_connections: int = limits.MAX_CONNECTIONS
    max_connections_per_addr: int = limits.MAX_CONNECTIONS_PER_ADDR
    idle_timeout: float = limits.IDLE_TIMEOUT
    frame_timeout: float = limits.FRAME_TIMEOUT
    send_timeout: float = limits.SEND_TIMEOUT
    handshake_timeout: float = limits.HANDSHAKE_TIMEOUT
    reply_budget: int = limits.REPLY_BUDGET
    receive_budget: int = limits.RECEIVE_BUDGET

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0")
        if self.max_connections_per_addr > self.max_connections:
            raise ValueError("max_connections_per_addr must be <= max_connections")
        if self.reply_budget < limits.MAX_FRAME or self.receive_budget < limits.MAX_FRAME:
            raise ValueError(f"the reply and receive budgets must hold a frame of MAX_FRAME "
                             f"({limits.MAX_FRAME}) bytes")


def add_arguments(ap) -> None:
    """The door's options of a server's command line."""
    d = DoorLimits()
    ap.add_argument("--max-connections", type=int, default=d.max_connections,
                    help=f"open connections this server takes (default {d.max_connections})")
    ap.add_argument("--max-connections-per-addr", type=int, default=d.max_connections_per_addr,
                    help=f"of those, from one address (default {d.max_connections_per_addr})")
    ap.add_argument("--idle-timeout", type=float, default=d.idle_timeout, metavar="SECONDS",
                    help=f"a connection with nothing in flight is closed after this "
                         f"(default {d.idle_timeout:.0f})")
    ap.add_argument("--frame-timeout", type=float, default=d.frame_timeout, metavar="SECONDS",
                    help=f"a request begun must arrive whole within this (default {d.frame_timeout:.0f})")


def from_args(args) -> DoorLimits:
    return DoorLimits(max_connections=args.max_connections,
                      max_connections_per_addr=args.max_connections_per_addr,
                      idle_timeout=args.idle_timeout, frame_timeout=args.frame_timeout)


class Door:
    def __init__(self, lim: DoorLimits | None = None):
        self.limits = lim or DoorLimits()
        self.open = 0
        self.by_addr: dict[str, int] = {}
        self.receiving = 0          # bytes of large frames still arriving, all connections
        self._room = trio.Event()   # set when ``receiving`` went down
        self.stats = dict.fromkeys(("accepted", "refused", "idle_cut", "frame_cut", "handshake_cut",
                                    "send_cut", "budget_cut", "auth_failed", "requests_refused",
                                    "tls_refused"), 0)

    def describe(self) -> dict:
        """Counters and what is held now (a server's ``stats`` carry it)."""
        return {**self.stats, "open": self.open, "receiving": self.receiving}

    def enter(self, addr: str) -> None:
        """A new connection from ``addr``, or ``ConnectionLimit``."""
        lim = self.limits
        n = self.by_addr.get(addr, 0)
        if self.open >= lim.max_connections or n >= lim.max_connections_per_addr:
            self.stats["refused"] += 1
            which = ("max_connections", lim.max_connections) if self.open >= lim.max_connections \
                else ("max_connections_per_addr", lim.max_connections_per_addr)
            raise ConnectionLimit(f"this server takes at most {which[1]} connections "
                                  f"({which[0]}); try again later", limit=which[0], bound=which[1])
        self.open += 1
        self.by_addr[addr] = n + 1
        self.stats["accepted"] += 1

    def leave(self, addr: str) -> None:
        self.open -= 1
        n = self.by_addr[addr] - 1
        if n:
            self.by_addr[addr] = n
        else:
            del self.by_addr[addr]

    def hold(self, delta: int) -> None:
        """A connection's bytes of a large frame still arriving moved by ``delta``."""
        self.receiving += delta
        if delta < 0:
            self._room.set()
            self._room = trio.Event()

    async def room(self) -> None:
        """Until the large frames still arriving hold less than the budget."""
        while self.receiving >= self.limits.receive_budget:
            await self._room.wait()


class Deadline:
    """When a connection is cut if nothing happens: the soonest of its timeouts that apply
    (``at``), and which one it is (``why``)."""

    __slots__ = ("limits", "accepted", "active", "frame_since")

    def __init__(self, lim: DoorLimits, now: float):
        self.limits = lim
        self.accepted = self.active = now
        self.frame_since: float | None = None   # a frame began arriving then

    def at(self, busy: bool, authenticated: bool) -> tuple[float, str]:
        lim = self.limits
        when, why = math.inf, ""
        if self.frame_since is not None:
            when, why = self.frame_since + lim.frame_timeout, "frame_cut"
        elif not busy:
            when, why = self.active + lim.idle_timeout, "idle_cut"
        if not authenticated and self.accepted + lim.handshake_timeout < when:
            when, why = self.accepted + lim.handshake_timeout, "handshake_cut"
        return when, why
