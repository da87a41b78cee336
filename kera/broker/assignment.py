"""Assignment: the streamlets the coordinator gives this broker to own (new, handed over,
or being recovered), their streams' changed configuration, and those it takes away.
"""

from __future__ import annotations

import logging
import time

from ..errors import InvalidArgument
from ..stream_meta import StreamMeta
from . import retention
from .ledger import Ledger
from .memory import MemoryBudget
from .reclaim import Reclaim
from .streamlet import Streamlet
from .takeover import Guard
from .vlogs import VirtualLogs

log = logging.getLogger("kera.broker")


class Assignment:
    """It owns the count of recoveries served here. Handed what the broker holds (``streams``,
    their ``names``, ``streamlets``; the ``memory`` budget and the ``ledger`` a new streamlet
    joins), the membership's checks (``guard``), the virtual logs (``logs``: live backups
    as the coordinator says, a full group's close, pulls woken) and the ``reclaim``er (what
    a streamlet dropped or recovered frees)."""

    def __init__(self, streams: dict[int, StreamMeta], names: dict[str, int],
                 streamlets: dict[tuple[int, int], Streamlet], memory: MemoryBudget, ledger: Ledger,
                 guard: Guard, logs: VirtualLogs, reclaim: Reclaim):
        self.streams, self.names, self.streamlets = streams, names, streamlets
        self.memory, self.ledger, self.guard, self.logs, self.reclaim = memory, ledger, guard, logs, reclaim
        self.recoveries_served = 0  # assignments of a dead broker's streamlets to rebuild here
        self.close_group = logs.close_group   # one bound method for every streamlet (64 B each)

    def assign(self, meta) -> dict:
        """Streamlets to own; ``recovering`` ones are rebuilt by backups before they serve.

        One stream (``stream``, ``streamlets``) or many (``streams``: [[stream, streamlets],
        ...]): a batch of new streams costs one request per broker; ``ids`` ([[stream id,
        streamlets], ...]) names streams whose maps an earlier assign gave (a recovery's
        hand-over).
        """
        self.guard.check_epoch(meta)
        entries, ids = meta.get("streams"), meta.get("ids")
        if entries is None and ids is None:
            if meta.get("stream") is None or meta.get("streamlets") is None:
                raise InvalidArgument("assign needs a stream and streamlets, streams, or ids")
            entries = [[meta["stream"], meta["streamlets"]]]
        entries = [(StreamMeta.from_wire(s), streamlets) for s, streamlets in entries or ()]
        for sid, streamlets in ids or ():   # streams whose map an earlier assign gave
            s = self.streams.get(sid)
            if s is None:
                raise InvalidArgument(f"assign names stream {sid} by id, and no map of it is held here")
            entries.append((s, streamlets))
        recovering = meta.get("recovering") is True
        seal = meta.get("seal") is True
        self.recoveries_served += recovering
        backups = meta.get("backups")
        if backups is not None:
            # the coordinator's view as of this stream: its first vsegs get copies on every
            # node, not only on the backups our last heartbeat answer knew of
            self.logs.set_backups(backups)
        for s, streamlets in entries:
            self.place(s, streamlets, recovering, seal)
        self.logs.notify_durable()  # pulls waiting on these streamlets look again
        return {}

    def place(self, s: StreamMeta, streamlets: list, recovering: bool, seal: bool) -> None:
        same = self.streams.get(s.id) is s   # named by id (``ids``): its streamlets have its settings
        self.streams[s.id] = s
        self.names[s.name] = s.id
        now = time.time()
        for i in streamlets:
            sl = self.streamlets.get((s.id, i))
            if sl is not None and not same:
                sl.configure(s)
            if sl is None:
                sl = self.streamlets[(s.id, i)] = Streamlet(s, i, self.memory, self.ledger)
                sl.on_close = self.close_group
                sl.recovering = recovering
            elif sl.recovering and recovering:   # an attempt again: it tells what is pending anew
                sl.forget_pending()
            elif sl.recovering and not recovering:
                sl.finish_recovery()
                if not sl.pending:   # else once its older groups are adopted (``Takeover.pend``)
                    self.reclaim.free(retention.expired(sl, now, settled_only=False))
                if seal:
                    log.error("stream %s streamlet %d: recovered with data lost; its groups are sealed",
                              s.name, i)
                    sl.seal()

    def configure(self, meta) -> dict:
        """A stream's changed configuration (retention): applied by the next reclaim pass."""
        self.guard.check_epoch(meta)
        s = StreamMeta.from_wire(meta.get("stream"))
        if s.id in self.streams:
            self.streams[s.id] = s
            for i in range(s.streamlets):   # its streamlets here, not every one held
                sl = self.streamlets.get((s.id, i))
                if sl is not None:
                    sl.configure(s)
        return {}

    def unassign(self, meta) -> dict:
        """Streamlets to drop: of one stream (``stream_id``, ``streamlets``, all if None) or of
        many (``streams``: [[stream id, streamlets or None], ...]). Costs what is dropped,
        not what this broker holds."""
        self.guard.check_epoch(meta)
        entries = meta.get("streams")
        if entries is None:
            if meta.get("stream_id") is None:
                raise InvalidArgument("unassign needs a stream_id, or streams")
            entries = [[meta["stream_id"], meta.get("streamlets")]]
        for sid, only in entries:
            s = self.streams.get(sid)
            if s is None:
                continue
            every = range(s.streamlets)
            for i in every if only is None else only:
                sl = self.streamlets.pop((sid, i), None)
                if sl is not None:
                    self.reclaim.free(sl.leave())
            if not any((sid, i) in self.streamlets for i in every):
                self.streams.pop(sid, None)
                if self.names.get(s.name) == sid:
                    del self.names[s.name]
        self.reclaim.once()
        return {}
