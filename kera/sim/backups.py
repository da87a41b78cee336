"""The simulated backups: copies kept as chunk ids, what they accept decided by the real
``kera.backup.store.BackupStore`` rules; what ``list``, ``index`` and ``replay`` answer."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from ..backup.store import NEW, BackupStore
from ..errors import KeraError
from ..recovery.plan import CORRUPT, END
from .placement import SimChunk

BROKER, EPOCH = 1, 1   # the simulated broker's id and incarnation


@dataclass
class SimReplica:
    """A copy as the simulator keeps it: chunk ids, not bytes. ``length``, ``closed``,
    ``damaged`` and ``error`` are what ``BackupStore``'s rules read of a replica."""

    chunks: list = field(default_factory=list)   # (cid, size), in order
    ends: list = field(default_factory=list)     # byte end of each
    closed: bool = False
    bad: set = field(default_factory=set)        # indexes of corrupt chunks
    known_bad: set = field(default_factory=set)  # ... of which the backup's index knows
    headers: set = field(default_factory=set)    # ... of which the flip hit the header
    reloaded: bool = False   # read back from its file (a restart): index checks the headers again
    damaged: bool = False
    error: str | None = None

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0


class SimBackup:
    """A backup process; what it accepts is decided by the real ``BackupStore`` rules."""

    def __init__(self, id: int, node: str):
        self.id, self.node = id, node
        self.incarnation = 1
        self.up = True          # process running (possibly paused)
        self.paused_until = 0.0
        self.declared_dead = False
        self.destroyed = False  # its disk is gone: never comes back
        self.store = BackupStore()
        self.replicas: dict[tuple[int, int, int], SimReplica] = self.store.replicas
        self.held: set[int] = set()  # chunk ids it ever wrote (damage later is the fault budget's)

    @property
    def full(self) -> bool:
        return self.store.max_bytes == 1

    @full.setter
    def full(self, full: bool) -> None:
        self.store.max_bytes = 1 if full else 0  # a full disk: no byte more, not even a trailer

    def replicate(self, vlog: int, vseg: int, offset: int, chunks: list, close: bool):
        """('ok', length), ('length', length) or ('error', why), as the backup service answers."""
        key = (BROKER, vlog, vseg)
        try:
            d = self.store.accept_replicate(key, EPOCH, offset, sum(size for _, size in chunks), close)
            if d.stores:
                self.store.check_limits(d)
        except KeraError as e:
            length = getattr(e, "length", None)
            return ("length", length) if isinstance(length, int) else ("error", str(e))
        if d.kind == NEW:
            self.replicas[key] = SimReplica()
        rep = self.replicas.get(key)
        if d.take:
            for cid, size in chunks:
                rep.chunks.append((cid, size))
                rep.ends.append(rep.length + size)
                self.held.add(cid)
        if d.close and d.stores:
            rep.closed = True
        return "ok", d.length

    def listing(self, vlog_ids) -> list[dict]:
        out = []
        for (_, vlog, vseg), rep in self.replicas.items():
            if vlog not in vlog_ids:
                continue
            corrupt = [{"offset": rep.ends[i] - rep.chunks[i][1], "length": rep.chunks[i][1],
                        "reason": "checksum"} for i in sorted(rep.known_bad)]
            out.append({"broker": BROKER, "vlog": vlog, "vseg": vseg, "length": rep.length,
                        "chunks": len(rep.chunks), "closed": rep.closed, "corrupt": corrupt,
                        "checksum": None})
        return out

    def index(self, vlog: int, vseg: int, rows_of, verify: bool = False) -> np.ndarray | None:
        """The index rows of a closed, intact copy; None when the backup refuses it, as the real
        ``index`` does: missing, not closed, known corrupt, or a header found rotten (then
        marked corrupt) when the copy was reloaded from its file; rows kept since the close
        are not checked again, so rot in a copy never reloaded is found only when read, or
        when the index is asked ``verify`` (every body read back: a flip found is marked)."""
        rep = self.replicas.get((BROKER, vlog, vseg))
        if rep is None or not rep.closed or rep.known_bad:
            return None
        if rep.reloaded and rep.headers or verify and rep.bad:
            rep.known_bad |= rep.headers if not verify else rep.bad
            return None
        return rows_of(vlog, vseg, [cid for cid, _ in rep.chunks], rep.ends)

    def intact(self, c: SimChunk) -> bool:
        """Whether this backup holds chunk ``c`` (at its vseg offset) uncorrupted."""
        rep = self.replicas.get((BROKER, c.vlog, c.vseg))
        if rep is None:
            return False
        i = bisect_right(rep.ends, c.voff)
        return i < len(rep.chunks) and rep.chunks[i][0] == c.cid and i not in rep.bad

    def reload(self) -> None:
        """The process restarted: its copies are read back from their files."""
        for rep in self.replicas.values():
            rep.reloaded = True

    def replay(self, vlog: int, vseg: int, offset: int):
        """Chunks from ``offset`` until the copy's end or its first corrupt chunk."""
        rep = self.replicas[(BROKER, vlog, vseg)]
        out, pos = [], offset
        for i, (cid, size) in enumerate(rep.chunks):
            start = rep.ends[i] - size
            if start < offset:
                continue
            if i in rep.bad:
                return out, start, CORRUPT, start + size
            out.append(cid)
            pos = rep.ends[i]
        return out, pos, END, None
