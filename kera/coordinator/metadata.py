"""One term's metadata: its store, the streams' catalog, and the changes made through them.

The store is a ``MetaLog`` in the data dir or an ``EtcdMeta`` in etcd; every change is
recorded as it is made, and a request whose change must survive a crash awaits
``commit()`` before it answers (one write for many requests). The parts of the
coordinator change the metadata only through here (or through the catalog it holds), so
what a term holds is in one place: the state (``state``, read by anyone, changed by none
but the store), the catalog of streams and its index of who owns which streamlets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..stream_meta import StreamMeta
from .catalog import Catalog

log = logging.getLogger("kera.coordinator")

INITIAL = {   # the metadata of a new cluster
    "next_stream_id": 1, "next_producer_id": 1, "next_epoch": 1,
    "next_id": {"broker": 1, "backup": 1}, "streams": {},
    "backups": [],   # every backup id ever registered
    "fences": {},    # broker id -> newest epoch fenced
    "recovered": [],  # [[broker, epoch, version], ...] recovered with nothing lost (kera.coordinator.recovered)
    "recovered_version": 0,
    "deferred": {},   # "broker:epoch" -> closed history adopted after its hand-over (kera.recovery.adoption)
    "users": {},      # name -> salted SCRAM keys (kera.security.accounts)
    "acls": [],       # [principal, permission, operation, resource, name, pattern], ...
    "security_version": 0,
}
PACKED = ("streams",)   # kept as each entry's msgpack bytes by the store (kera.coordinator.catalog)


class Metadata:
    """``store``'s state, its catalog and its changes. ``committed(version, seconds)``: a
    commit returned, every entry of the recovered list up to ``version`` durable, in
    ``seconds``."""

    def __init__(self, store, committed: Callable[[int, float], None]):
        self.store = store
        self.state = store.state   # changed only through the store
        self._committed = committed
        # meta["streams"] (each stream's map, packed), decoded on demand, and its indexes
        self.streams = Catalog(store)
        self.holdings = self.streams.holdings   # incarnation -> streamlets
        self._deleting: dict[int, list] = {}   # stream id -> owners to unassign, moved by set_owner
        if "positions" in self.state:   # group positions of an older version: they start afresh
            log.warning("dropping the positions of %d consumer groups committed by an older "
                        "version: those groups start afresh", len(self.state["positions"] or {}))
            store.delete(("positions",))

    def set(self, path: tuple, value) -> None:
        self.store.set(path, value)

    def delete(self, path: tuple) -> None:
        self.store.delete(path)

    async def commit(self) -> None:
        """Until every metadata change made so far is on disk."""
        recovered = self.state["recovered_version"]
        t0 = time.perf_counter()
        await self.store.commit()
        self._committed(recovered, time.perf_counter() - t0)

    def take(self, counter: str) -> int:
        """The next value of ``counter`` (``next_stream_id``, ...), never handed out again once
        committed."""
        v = self.state[counter]
        self.store.set((counter,), v + 1)
        return v

    def fence(self, broker: int, epoch: int) -> None:
        """From now on, no backup accepts replicas of ``broker`` from ``epoch`` or older
        (durable once ``commit`` returns)."""
        k = str(broker)
        if self.state["fences"].get(k, 0) < epoch:
            self.store.set(("fences", k), epoch)

    def set_owner(self, s: StreamMeta, i: int, m, was=None) -> None:
        """Streamlet ``i`` of ``s`` is now member ``m``'s (durable once ``commit`` returns).
        ``was``: the incarnation that should own it now (a recovery's dead one): if it does,
        the stream's map is not decoded to find out (a third of a million per recovery)."""
        if was is not None and self.streams.owned(s.name, s.id, i, was):
            self.streams.set_owner(s.name, i, was, (m.id, m.epoch))
            return
        now = self.streams.wire(s.name)    # its map, not decoded: the owner it has now
        if now is None or now["id"] != s.id:   # deleted (or re-created) meanwhile: nothing to keep
            if s.id in self._deleting:      # (a delete still committing unassigns it from m too)
                self._deleting[s.id][i] = (m.id, m.epoch)
            return
        self.streams.set_owner(s.name, i, tuple(now["owners"][i]), (m.id, m.epoch))

    async def delete_stream(self, s: StreamMeta) -> list:
        """``s`` deleted, durably; returns the owners to unassign it from (an owner a recovery
        hands a streamlet of it meanwhile included)."""
        self.streams.delete(s)
        owners = self._deleting[s.id] = list(s.owners)
        try:
            await self.commit()
        finally:
            del self._deleting[s.id]
        return owners

    def now(self, s: StreamMeta) -> StreamMeta:
        """``s`` as it is now (altered or moved since it was read), unless it was deleted."""
        now = self.streams.get(s.name)
        return now if now is not None and now.id == s.id else s

    def wires(self, ss: list[StreamMeta]) -> list[dict]:
        """``wire`` of each of ``ss``, their maps decoded in one call (a recovery hands a third
        of a million to a broker)."""
        return [d if d is not None and d["id"] == s.id else s.to_wire()
                for s, d in zip(ss, self.streams.wires([s.name for s in ss]), strict=True)]

    def wire(self, s: StreamMeta) -> dict:
        """``s``'s map as it is now (altered or moved since it was read: as the store holds
        it), or ``s.to_wire()`` once deleted."""
        d = self.streams.wire(s.name)
        return d if d is not None and d["id"] == s.id else s.to_wire()
