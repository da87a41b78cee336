"""What recovery is handed by the coordinator: the narrow interfaces it is composed with.

``RecoveryManager`` and ``Adoptions`` never see the coordinator whole: it hands them its
parts, which they know only by these shapes, so their constructors say everything they
touch, and recovery imports nothing of the coordinator (which imports recovery). The
coordinator's parts that fit them: ``Liveness`` is its ``Roster``
(``kera.coordinator.membership``), ``MetaStore`` its ``Metadata``, ``Owners`` its
``Placement`` and ``RecoveredList`` its ``Recovered``; a ``Server`` is a ``Member``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ..limits import CHUNK_ROWS_NEWEST
from ..stream_meta import StreamMeta
from .holdings import Holdings, Incarnation


class Server(Protocol):
    """A server as the coordinator knows it (``kera.coordinator.membership.Member``)."""

    id: int
    addr: str
    epoch: int
    alive: bool
    told: set[int]    # a broker: every backup it was told is alive (so may hold its copies)
    told_all: bool    # ``told`` is all it was ever told (not so after a coordinator change)
    stats: dict       # its last heartbeat's


class Liveness(Protocol):
    """Who is alive, this term (``kera.coordinator.membership.Roster``)."""

    members: dict[str, dict[int, Server]]   # role -> id -> member registered this term
    ready: bool                             # the nodes had their time to rejoin

    def live(self, role: str) -> list[Server]: ...

    def live_broker(self, bid: int, epoch: int | None = None) -> Server | None: ...

    def incarnation(self, bid: int, epoch: int) -> Server | None: ...

    def forget(self, keep: Callable[[Incarnation], bool]) -> None: ...

    def notify(self) -> None: ...


class Streams(Protocol):
    """The streams by name and id (``kera.coordinator.catalog.Catalog``)."""

    def __contains__(self, name) -> bool: ...

    def __getitem__(self, name) -> StreamMeta: ...

    def __iter__(self) -> Iterator[str]: ...

    def get(self, name) -> StreamMeta | None: ...

    def by_id(self, sid: int) -> StreamMeta | None: ...


class MetaStore(Protocol):
    """The term's metadata (``kera.coordinator.metadata.Metadata``): a change is durable
    once ``commit`` returns."""

    state: dict            # read only: changed through ``set`` and ``delete``
    streams: Streams
    holdings: Holdings     # incarnation -> the streamlets it owns

    def set(self, path: tuple, value) -> None: ...

    def delete(self, path: tuple) -> None: ...

    def fence(self, broker: int, epoch: int) -> None: ...

    def set_owner(self, s: StreamMeta, i: int, m: Server, was: tuple[int, int] | None = None) -> None: ...

    async def commit(self) -> None: ...


class Owners(Protocol):
    """Owners among the live brokers (``kera.coordinator.placement.Placement``)."""

    def spread(self, n: int, salt: int = 0) -> list[Server]: ...

    async def assign(self, m: Server, entries: list, recovering: bool = False,
                     seal: bool = False) -> None: ...


class RecoveredList(Protocol):
    """The incarnations every backup lets go of (``kera.coordinator.recovered.Recovered``)."""

    def add(self, broker: int, epoch: int, covered: list) -> None: ...


@dataclass(frozen=True, slots=True)
class Settings:
    """How recoveries run (the coordinator's options)."""

    grace: float                 # after a coordinator start, time for backups to come back
    rejoin_wait: float           # ... and for live brokers to rejoin as themselves first
    repoint_evicted: bool = True  # settled history re-pointed, not replayed (kera.recovery.repoint)
    chunk_rows_newest: int = CHUNK_ROWS_NEWEST
