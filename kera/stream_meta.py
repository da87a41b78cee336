"""A stream's metadata: one typed, immutable view of it inside every process.

The coordinator decides a stream's shape and settings when it is created
(and ``alter`` changes its retention or compaction), and where each
streamlet lives; brokers, backups' recovery and clients all read them.
Inside a process a stream is a ``StreamMeta``; it is a msgpack map only at
the wire and in the coordinator's metadata store, crossed by ``from_wire``
and ``to_wire`` alone. The map keeps the field names and order it always
had, so data dirs and etcd keys written before this module still load.

Keys a newer writer added are kept in ``extra`` and written back by
``to_wire``: during a rolling upgrade a newer coordinator's maps reach older
brokers and clients, and an older coordinator may load a newer data dir;
refusing them would stop those processes, dropping them would lose the
newer settings at the next rewrite of the stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from .errors import InvalidArgument

Owner = tuple[int, int]    # (broker id, epoch): the incarnation serving a streamlet

_INTS = ("id", "streamlets", "groups", "replication", "segment_size", "group_segments")
_OPTIONAL_INTS = ("retention_bytes", "retention_ms", "delete_retention_ms", "segment_ms")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(slots=True, kw_only=True)
class StreamMeta:
    """Never changed in place: ``with_owner`` and ``altered`` make the changed copy that
    replaces it. Not ``frozen``: a frozen dataclass is built about four times slower (each
    field set through ``object.__setattr__``), and the coordinator builds one per created
    stream, every broker one per stream it is assigned."""

    name: str
    id: int                       # never reused: a stream re-created under a name gets a new one
    streamlets: int               # S: partitions, each the ordering unit of a key
    groups: int                   # Q: active groups per streamlet (a producer writes to id % Q)
    replication: int             # R: copies of every chunk (the broker's and R-1 backups')
    segment_size: int             # bytes of one segment
    group_segments: int           # G: segments of a group before it closes
    owners: tuple[Owner, ...]     # streamlet i is served by incarnation owners[i]
    vlogs: str | None = None      # vlog mapping policy (kera.vlog.mapping); None: the broker's
    retention_bytes: int = -1     # the stream's total, split evenly over streamlets; -1 unbounded
    retention_ms: int = -1        # -1 unbounded
    cleanup_policy: str = "delete"    # "delete", "compact" or "compact,delete" (Kafka's names)
    delete_retention_ms: int | None = None   # a tombstone's life once compacted; None: the default
    segment_ms: int | None = None  # a compacted stream's newest segment rolls after it; None: default
    created: float = 0.0          # unix time
    extra: Mapping[str, Any] | None = None   # keys of a newer writer, kept for its sake

    # the wire keys this class reads; the rest go to ``extra``
    WIRE_KEYS: ClassVar[frozenset[str]]

    @property
    def compacted(self) -> bool:
        return "compact" in self.cleanup_policy

    def with_owner(self, i: int, owner: Owner) -> StreamMeta:
        """This stream with streamlet ``i`` served by ``owner``."""
        owners = list(self.owners)
        owners[i] = owner
        return dataclasses.replace(self, owners=tuple(owners))

    def altered(self, changes: Mapping[str, Any]) -> StreamMeta:
        """This stream with the settings of ``changes`` (field names, values checked)."""
        return dataclasses.replace(self, **changes)

    # -- the boundary -------------------------------------------------------------------
    @classmethod
    def from_wire(cls, d):
        """The typed view of a map from the wire or the metadata store; ``InvalidArgument``
        naming the key if it lacks one or a value has the wrong type."""
        if not isinstance(d, dict):
            raise InvalidArgument("stream metadata must be a map")
        try:
            for k in _INTS:
                if not _int(d[k]):
                    raise InvalidArgument(f"stream metadata: {k} must be an integer, not {d[k]!r}")
            kw = {k: d[k] for k in _INTS}
            name, owners = d["name"], d["owners"]
        except KeyError as e:
            raise InvalidArgument(f"stream metadata lacks {e.args[0]!r}") from None
        if not isinstance(name, str):
            raise InvalidArgument(f"stream metadata: name must be a string, not {name!r}")
        if not isinstance(owners, (list, tuple)):
            raise InvalidArgument("stream metadata: owners must be a list of [broker, epoch]")
        try:
            kw["owners"] = tuple((b, e) for b, e in owners if _int(b) and _int(e))
        except (TypeError, ValueError):
            kw["owners"] = ()
        if len(kw["owners"]) != len(owners):
            raise InvalidArgument("stream metadata: owners must be a list of [broker, epoch]")
        for k in _OPTIONAL_INTS:
            v = d.get(k)
            if v is not None:
                if not _int(v):
                    raise InvalidArgument(f"stream metadata: {k} must be an integer, not {v!r}")
                kw[k] = v
        for k, types in (("vlogs", str), ("cleanup_policy", str), ("created", (int, float))):
            v = d.get(k)
            if v is not None:
                if not isinstance(v, types):
                    raise InvalidArgument(f"stream metadata: {k} has the wrong type: {v!r}")
                kw[k] = v
        unknown = d.keys() - cls.WIRE_KEYS
        if unknown:
            kw["extra"] = {k: d[k] for k in unknown}
        return cls(name=name, **kw, **cls._more_from_wire(d))

    @classmethod
    def _more_from_wire(cls, d: dict) -> dict:
        """A subclass's own fields from ``d``."""
        return {}

    def to_wire(self) -> dict:
        """The map as the coordinator has always written it (owners as lists, which the
        metadata store changes in place; unset optional settings left out)."""
        d = {"name": self.name, "id": self.id, "streamlets": self.streamlets, "groups": self.groups,
             "replication": self.replication, "segment_size": self.segment_size,
             "group_segments": self.group_segments, "vlogs": self.vlogs,
             "retention_bytes": self.retention_bytes, "retention_ms": self.retention_ms,
             "cleanup_policy": self.cleanup_policy}
        if self.delete_retention_ms is not None:
            d["delete_retention_ms"] = self.delete_retention_ms
        if self.segment_ms is not None:
            d["segment_ms"] = self.segment_ms
        d["owners"] = [[b, e] for b, e in self.owners]
        d["created"] = self.created
        if self.extra:
            d.update(self.extra)
        return d


StreamMeta.WIRE_KEYS = frozenset(f.name for f in dataclasses.fields(StreamMeta)) - {"extra"}
