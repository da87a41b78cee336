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
_REQUIRED = frozenset(("name", "owners", *_INTS))
_OPTIONAL = {"retention_bytes": (int,), "retention_ms": (int,), "delete_retention_ms": (int,),
             "segment_ms": (int,), "vlogs": (str,), "cleanup_policy": (str,), "created": (float, int)}
_NULLABLE = frozenset(("vlogs", "delete_retention_ms", "segment_ms"))   # None: the broker's default


def _refusal(d) -> InvalidArgument:
    """Why ``d`` is not a stream's map (``StreamMeta.from_wire`` found that it is not)."""
    if type(d) is not dict:
        return InvalidArgument("stream metadata must be a map")
    for k in sorted(_REQUIRED - d.keys()):
        return InvalidArgument(f"stream metadata lacks {k!r}")
    if type(d["name"]) is not str:
        return InvalidArgument(f"stream metadata: name must be a string, not {d['name']!r}")
    for k in _INTS:
        if type(d[k]) is not int:
            return InvalidArgument(f"stream metadata: {k} must be an integer, not {d[k]!r}")
    for k, types in _OPTIONAL.items():
        if k in d and not (d[k] is None and k in _NULLABLE) and type(d[k]) not in types:
            what = "an integer" if types[0] is int else "a string" if types[0] is str else "a number"
            return InvalidArgument(f"stream metadata: {k} must be {what}, not {d[k]!r}")
    return InvalidArgument("stream metadata: owners must be a list of [broker, epoch]")


@dataclasses.dataclass(slots=True)
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
        """This stream with the settings of ``changes`` (field names; the values are the
        coordinator's, checked there)."""
        return dataclasses.replace(self, **changes)

    # -- the boundary -------------------------------------------------------------------
    @classmethod
    def from_wire(cls, d):
        """The typed view of a map from the wire or the metadata store; ``InvalidArgument``
        naming the key if it lacks one or a value has the wrong type. Checked in one
        expression (a broker reads thousands in one assign); ``_refusal`` says what is wrong."""
        try:
            name, sid, streamlets, groups, replication, size, gsegs, owners = (
                d["name"], d["id"], d["streamlets"], d["groups"], d["replication"],
                d["segment_size"], d["group_segments"], d["owners"])
        except (KeyError, TypeError):
            raise _refusal(d) from None
        get = d.get
        rb, rm, dr, sm = get("retention_bytes", -1), get("retention_ms", -1), \
            get("delete_retention_ms"), get("segment_ms")
        vlogs, policy, created = get("vlogs"), get("cleanup_policy", "delete"), get("created", 0.0)
        if not (type(d) is dict and type(name) is str and type(sid) is int and type(streamlets) is int
                and type(groups) is int and type(replication) is int and type(size) is int
                and type(gsegs) is int and type(rb) is int and type(rm) is int
                and (dr is None or type(dr) is int) and (sm is None or type(sm) is int)
                and (vlogs is None or type(vlogs) is str) and type(policy) is str
                and (type(created) is float or type(created) is int) and type(owners) is list):
            raise _refusal(d)
        try:
            owned = tuple([(b, e) for b, e in owners if type(b) is int and type(e) is int])
        except (TypeError, ValueError):
            owned = ()
        if len(owned) != len(owners):
            raise _refusal(d)
        extra = None if d.keys() <= cls.WIRE_KEYS else {k: v for k, v in d.items() if k not in cls.WIRE_KEYS}
        # positional: a third of the cost of naming 16 arguments
        return cls(name, sid, streamlets, groups, replication, size, gsegs, owned, vlogs, rb, rm, policy,
                   dr, sm, created, extra, *cls._more_from_wire(d))

    @classmethod
    def _more_from_wire(cls, d: dict) -> tuple:
        """A subclass's own fields from ``d``, in their order."""
        return ()

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
