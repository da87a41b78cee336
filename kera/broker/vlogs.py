"""The broker's virtual logs: which vlog a group's chunks go to, the backups they are
replicated to (live as the coordinator last said), and the replication of one incarnation
(``ReplicationHub``: one replicate RPC in flight per backup for every vlog; ``Rebuilder``:
a frozen vseg's lost copies made again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .. import chunk
from ..errors import Unavailable
from ..rpc import Pool
from ..stream_meta import StreamMeta
from ..vlog import BackupSet, VirtualLog, VlogMapping, vlog_id
from .group_close import close_chunk
from .rebuild import Rebuilder
from .replicator import ReplicationHub, Replicator
from .segment import VlogChunk
from .streamlet import Streamlet

log = logging.getLogger("kera.broker")


class VirtualLogs:
    """It owns the vlogs (by the ``mapping``'s key), the live backups and their set, the event
    set whenever more is durable, and the incarnation's hub and rebuilder. Handed the broker's
    ``node`` (copies go to other nodes), the vlogs' ``vseg_size`` and ``replicate_timeout``,
    the ``streams`` held (a closed group's stream) and who we are (``ident``: broker id,
    epoch)."""

    def __init__(self, node: str, mapping: VlogMapping, vseg_size: int, replicate_timeout: float,
                 streams: dict[int, StreamMeta], ident: Callable[[], tuple[int | None, int]]):
        self.mapping, self.vseg_size, self.replicate_timeout = mapping, vseg_size, replicate_timeout
        self.streams, self.ident = streams, ident
        self.vlogs: dict[tuple, Replicator] = {}
        self.backups: dict[int, dict] = {}
        self.backup_set = BackupSet(node)
        self.durable_event = trio.Event()
        self.hub: ReplicationHub | None = None   # the incarnation's replication (all its vlogs)
        self.rebuilder: Rebuilder | None = None  # its frozen vsegs' lost copies made again

    def start(self, incarnation: trio.Nursery, pool: Pool) -> None:
        """One incarnation's replication and rebuilding, in its nursery."""
        self.hub = ReplicationHub(pool, self.ident, self.backup_addr, self.replicate_timeout)
        incarnation.start_soon(self.hub.run)
        self.rebuilder = Rebuilder(pool, self.ident, self.backup_addr, self.backup_set,
                                   lambda: self.vlogs.values(), self.backup_damage)
        incarnation.start_soon(self.rebuilder.run)

    def reset(self) -> None:
        """A fenced incarnation's vlogs and backups are forgotten."""
        self.vlogs.clear()
        self.mapping.turn = 0
        self.backups.clear()
        self.backup_set.set_live({})

    def notify_durable(self) -> None:
        self.durable_event.set()
        self.durable_event = trio.Event()

    def backup_addr(self, backup_id: int) -> str:
        b = self.backups.get(backup_id)
        if b is None:
            raise Unavailable(f"backup {backup_id} is not alive")
        return b["addr"]

    def backup_damage(self) -> dict[int, int]:
        """Live backup -> how many corrupt chunks it has found on its disk (this incarnation)."""
        return {b: v.get("damage", 0) for b, v in self.backups.items()}

    def set_backups(self, live: list[dict]) -> None:
        """Membership from a heartbeat answer: a backup gone or restarted is replaced at once."""
        new = {b["id"]: b for b in live}
        same = new.keys() == self.backups.keys() and all(
            new[k]["addr"] == self.backups[k]["addr"] and new[k]["epoch"] == self.backups[k]["epoch"]
            for k in new)
        if same and all(new[k].get("damage") == self.backups[k].get("damage") for k in new):
            return
        self.backups = new
        if not same:
            changed = self.backup_set.set_live({b: (v["node"], v["epoch"]) for b, v in new.items()})
            log.info("live backups: %s", sorted(new))
            for b in changed:
                log.warning("backup %d gone or restarted: its copies are made again", b)
            for v in self.vlogs.values():
                v.poke()
        if self.rebuilder is not None:   # a backup that found damage on its disk is asked too
            self.rebuilder.poke()

    def vlog_for(self, stream: StreamMeta, streamlet: int, g) -> Replicator:
        """The group's virtual log (chosen on its first chunk, then cached on it)."""
        if g.vlog is not None:
            return g.vlog
        key = self.mapping.key(stream, streamlet, g.id)
        v = self.vlogs.get(key)
        if v is None:
            # ids unique across incarnations: a restarted broker never mixes with its old replicas
            vid = vlog_id(self.ident()[1], len(self.vlogs))
            vlog = VirtualLog(vid, stream.replication, self.vseg_size, self.backup_set,
                              self.replicate_timeout)
            v = self.vlogs[key] = Replicator(vlog, self.hub, self.notify_durable,
                                             lambda: [(b, m["addr"]) for b, m in self.backups.items()])
        g.vlog = v
        return v

    def close_group(self, sl: Streamlet, g, producer: int) -> None:
        """``g`` is full and closed: its close chunk goes to its vlog, after all its chunks."""
        c = close_chunk(sl.stream_id, sl.index, g, producer)
        self.append_close(sl, g, c, chunk.parse_header(c.view).body_checksum)

    def append_close(self, sl: Streamlet, g, c: VlogChunk, body_checksum: int) -> tuple:
        vlog = self.vlog_for(self.streams[sl.stream_id], sl.index, g)
        return vlog, vlog.append(c, 0, c.head, body_checksum)

    def stats(self) -> list[dict]:
        out = []
        for r in self.vlogs.values():
            v = r.log
            out.append({"vlog": v.id, "replication": v.replication, "appended": v.appended,
                        "durable": v.durable, "lag": v.lag(), "messages": v.messages,
                        "failures": v.failures, "give_ups": v.give_ups, **v.copies_held(),
                        "trimmed": r.trimmed, "reclaimed": r.reclaimed})
        return out

    def vsegs(self) -> list[list]:
        """Every virtual segment: [vlog, id, size, closed, the backups holding it (the broker's
        belief: a frozen vseg keeps a departed backup's copy), replication, frozen]."""
        return [[v.log.id, vs.id, vs.size, vs.closed, sorted(vs.copies), v.log.replication, vs.frozen]
                for v in self.vlogs.values() for vs in v.log.vsegs]
