"""Calls to whichever coordinator leads.

With several coordinators (one leads, the others stand by on etcd), every
server, client and CLI command is given their addresses as one
comma-separated list and finds the leader itself: the last leader found is
asked first, a standby answers ``not_leader`` naming the leader when it knows
it, and an address that does not answer is skipped. Only transport failures
and ``not_leader`` move the call on; any other answer, ``unavailable``
included, is the leader's and is raised as is.

An address that went silent (its host cut off, or paused) never fails a
connection: with several addresses, one attempt gets at most its share of the
call's time (``timeout / len(addrs)``, connecting included), and an address that
failed stops being the first one asked, so a call (a heartbeat) reaches a
standby that took over within the call instead of spending all its time on
the silent one, call after call. A request that may have reached an address
that did not answer (sent, then silence or a broken connection) is never sent
there again within the call (the coordinator may have applied it: a stream
created twice is ``stream_exists``); the call then ends with that failure.
"""

from __future__ import annotations

import os

import trio

from ..errors import InvalidArgument, NotLeader, Unavailable
from ..rpc import parse_addr

PORT = 7700                  # a coordinator's port unless told otherwise
DEFAULT = f"127.0.0.1:{PORT}"
ENV = "KERA_COORDINATOR"     # the coordinators' addresses, for whoever is given none


def default_addrs() -> str:
    """The coordinators' addresses when none is given: ``$KERA_COORDINATOR``, else ``DEFAULT``."""
    return os.environ.get(ENV) or DEFAULT


def split_addrs(addrs: str | list[str]) -> list[str]:
    out = [a.strip() for a in (addrs.split(",") if isinstance(addrs, str) else addrs) if a.strip()]
    if not out:
        raise InvalidArgument("no coordinator address given")
    for a in out:
        try:
            parse_addr(a)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    return out


class CoordinatorLink:
    """``call`` like ``Pool.call``, addressed to the leading coordinator of ``addrs``."""

    MAX_BACKOFF = 0.5

    def __init__(self, pool, addrs: str | list[str]):
        self.pool = pool
        self.addrs = split_addrs(addrs)
        self.single = len(self.addrs) == 1   # fails fast, as a plain call would
        self.leader = self.addrs[0]

    def __str__(self) -> str:
        return ",".join(self.addrs)

    async def call(self, method: str, meta: dict | None = None, payload=b"", *,
                   timeout: float = 30.0, **kw):
        """Until an answer or ``timeout``, going round the addresses with a capped backoff."""
        deadline = trio.current_time() + timeout
        share = timeout / len(self.addrs)   # an attempt's time at most, several addresses given
        delay, last, silent = 0.02, None, None
        unanswered: set[str] = set()   # may hold the request: not asked again in this call
        while True:
            todo = [a for a in [self.leader, *(a for a in self.addrs if a != self.leader)]
                    if a not in unanswered]
            tried: set[str] = set()
            while todo and deadline > trio.current_time():
                addr = todo.pop(0)
                tried.add(addr)
                left = deadline - trio.current_time()
                try:
                    out = await self.pool.call(addr, method, meta, payload,
                                               timeout=left if self.single else min(left, share), **kw)
                    self.leader = addr
                    return out
                except NotLeader as e:
                    last = e
                    hint = getattr(e, "leader", "")
                    if hint and hint not in tried and hint not in unanswered:
                        if hint not in self.addrs:
                            self.addrs.append(hint)
                        self.leader = hint
                        if hint in todo:
                            todo.remove(hint)
                        todo.insert(0, hint)
                    elif self.single:
                        raise
                except Unavailable as e:
                    if getattr(e, "_peer", None) or self.single:
                        raise   # the coordinator answered, or there is nowhere else to go
                    last = e
                    if not getattr(e, "_unsent", False):
                        unanswered.add(addr)
                        silent = e
                    if addr == self.leader:   # asked first no more: the others are
                        self.leader = self.addrs[(self.addrs.index(addr) + 1) % len(self.addrs)]
            left = deadline - trio.current_time()
            if left <= 0:
                raise silent or last or Unavailable(f"no coordinator of {self} answered {method}")
            await trio.sleep(min(delay, left))
            delay = min(delay * 2, self.MAX_BACKOFF)
