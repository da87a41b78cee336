"""Consumer-group positions as records of an internal compacted stream.

Kafka keeps them in ``__consumer_offsets``, Liftbridge in its cursors stream; here
``__consumer_positions``, created by the coordinator on first use with
``cleanup_policy`` compact. A commit is one keyed record per stream the group reads:

- key: msgpack ``[group, stream]``;
- value: msgpack ``[stream_id, [[streamlet, low, {group: pos}, {group: [pos, skip]}], ...]]``
  (a consumer position, ``kera_client.consumer``; the stream id lets a stream
  re-created under the same name start fresh); a Kafka consumer's commit adds the
  partition's offset and the commit's metadata to each entry (``kera.kafka.offsets``).

Compaction keeps the latest record per key, so the stream holds about one record per
(group, stream). All of a group's records go to one streamlet (``streamlet_of``):
a commit is one chunk and one append, and fetching a group's positions reads that
streamlet only, never the whole stream. The name starts with ``__``, which a user's
stream name cannot (``kera.names``): users can neither create nor delete it.

Positions cross this module in the consumer's JSON-friendly shape:
``{"stream/streamlet": {"low": L, "groups": {"g": pos}, "skip": {"g": [pos, records]}}}``.
"""

from __future__ import annotations

import msgpack
import xxhash

from .errors import InvalidArgument
from .names import MAX_NAME

NAME = "__consumer_positions"
# created with these (replication: the cluster's default, min(3, nodes)); segments are
# allocated on first append, so an unused stream costs only its metadata
SHAPE = {"streamlets": 8, "groups": 1, "segment_size": 1 << 20, "cleanup_policy": "compact"}


def check_group(group) -> str:
    if not isinstance(group, str) or not group or len(group) > MAX_NAME:
        raise InvalidArgument(f"a consumer group name is a string of 1 to {MAX_NAME} characters")
    return group


def group_of(key) -> str | None:
    """The group a record's key names, None if it is not a key of this stream."""
    try:
        k = msgpack.unpackb(key, raw=False)
    except Exception:  # noqa: BLE001 (msgpack raises several unrelated types)
        return None
    return k[0] if isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) else None


def streamlet_of(group: str, streamlets: int) -> int:
    """The streamlet all of ``group``'s records go to."""
    return xxhash.xxh32_intdigest(group.encode()) % streamlets


def encode(group: str, positions: dict, ids: dict[str, int]) -> tuple[list[bytes], list[bytes]]:
    """(keys, values) of one commit: a record per stream of ``positions`` (``ids``: name -> id)."""
    by_stream: dict[str, list] = {}
    for where, p in positions.items():
        name, _, i = where.rpartition("/")
        skip = {int(g): list(v) for g, v in (p.get("skip") or {}).items()}
        by_stream.setdefault(name, []).append(
            [int(i), p["low"], {int(g): v for g, v in p["groups"].items()}, skip])
    keys = [msgpack.packb([group, name]) for name in by_stream]
    values = [msgpack.packb([ids[name], sls]) for name, sls in by_stream.items()]
    return keys, values


def decode(group: str, latest: dict[bytes, bytes], ids: dict[str, int] | None = None) -> dict:
    """``group``'s positions from the latest value of every key of its streamlet; with
    ``ids`` (name -> id), only of those streams, as they are now (a stream re-created
    since the commit has another id)."""
    out = {}
    if ids is not None and len(ids) < len(latest):   # only those streams' keys are read
        latest = {k: v for k in (msgpack.packb([group, name]) for name in ids)
                  if (v := latest.get(k)) is not None}
    for key, value in latest.items():
        try:
            g, name = msgpack.unpackb(key)
            if g != group or not value:
                continue
            sid, sls = msgpack.unpackb(value, strict_map_key=False)
            if ids is not None and ids.get(name) != sid:
                continue
            mine = {}
            for i, low, groups, skip, *_kafka in sls:   # a Kafka commit adds its offset and metadata
                e = mine[f"{name}/{i}"] = {"low": low, "groups": {str(k): v for k, v in groups.items()}}
                if skip:
                    e["skip"] = {str(k): v for k, v in skip.items()}
        except (ValueError, TypeError, AttributeError, msgpack.UnpackException):
            continue   # not a commit (written to the stream by something else): never one's positions
        out.update(mine)
    return out
