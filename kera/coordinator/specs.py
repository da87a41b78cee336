"""A stream's spec, checked: its shape, retention and compaction, defaults filled in.

What ``create_stream(s)`` and ``alter_stream`` accept, decided here and nowhere else (pure:
no state but the cluster's defaults it is handed). Kafka's names are taken beside ours
(``retention.bytes`` for ``retention_bytes``), with Kafka's meaning.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import limits
from ..errors import InvalidArgument, LimitExceeded, NotEnoughBackups, StreamExists
from ..names import check_stream_name

DEFAULTS = {
    "streamlets": 1,
    "groups": 1,
    "replication": 3,
    "segment_size": 1 << 20,
    "group_segments": 8,
}
VLOG_POLICIES = ("shared", "per-stream", "per-group")
# retention, Kafka's names and meaning (-1: unbounded); the cluster's defaults are the
# coordinator's --retention-bytes / --retention-ms. retention_bytes is the stream's total.
RETENTION = {"retention_bytes": "retention.bytes", "retention_ms": "retention.ms"}
RETENTION_DEFAULTS = {"retention_bytes": -1, "retention_ms": -1}
# key compaction, Kafka's names and meaning: cleanup.policy, delete.retention.ms (tombstones),
# segment.ms (a compacted stream's newest segment is rolled, and so compacted, after it)
CLEANUP = {"cleanup_policy": "cleanup.policy", "delete_retention_ms": "delete.retention.ms",
           "segment_ms": "segment.ms"}
CLEANUP_POLICIES = ("delete", "compact", "compact,delete")


def retention(spec: dict) -> dict:
    """The retention settings a spec gives (either spelling), checked: -1 or >= 0."""
    out = {}
    for key, kafka in RETENTION.items():
        v = spec.get(key, spec.get(kafka))
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < -1:
            raise InvalidArgument(f"{kafka} must be an integer >= 0, or -1 for unbounded, not {v!r}")
        out[key] = v
    return out


def cleanup_policy(spec: dict, groups: int = 1) -> dict:
    """The compaction settings a spec gives (either spelling), checked. Compaction keeps the
    last record per key in a streamlet's one order, so a compacted stream has one active
    group per streamlet (``groups`` > 1 would let two producers' writes of a key race)."""
    out = {}
    for key, kafka in CLEANUP.items():
        v = spec.get(key, spec.get(kafka))
        if v is None:
            continue
        if key == "cleanup_policy":
            v = ",".join(sorted(p.strip() for p in v.split(","))) if isinstance(v, str) else v
            if v not in CLEANUP_POLICIES:
                raise InvalidArgument(f"{kafka} must be one of {', '.join(CLEANUP_POLICIES)}, not {v!r}")
        elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidArgument(f"{kafka} must be an integer >= 0, not {v!r}")
        out[key] = v
    if "compact" in out.get("cleanup_policy", "") and groups > 1:
        raise InvalidArgument(f"cleanup.policy {out['cleanup_policy']} needs groups=1 (one order per "
                              f"streamlet for the latest record of a key), not {groups}")
    return out


def check_limits(cfg: dict) -> None:
    """A stream's shape within ``kera.limits``; refused with the limit's name otherwise."""
    for key, name, high in (("streamlets", "MAX_STREAMLETS", limits.MAX_STREAMLETS),
                            ("groups", "MAX_GROUPS", limits.MAX_GROUPS),
                            ("segment_size", "MAX_SEGMENT_SIZE", limits.MAX_SEGMENT_SIZE)):
        if cfg[key] > high:
            raise LimitExceeded(f"{key} {cfg[key]} exceeds {name} ({high})",
                                limit=name, bound=high, size=cfg[key])
    if cfg["segment_size"] < limits.MIN_SEGMENT_SIZE:
        raise LimitExceeded(f"segment_size {cfg['segment_size']} is below MIN_SEGMENT_SIZE "
                            f"({limits.MIN_SEGMENT_SIZE})", limit="MIN_SEGMENT_SIZE",
                            bound=limits.MIN_SEGMENT_SIZE, size=cfg["segment_size"])


def config(spec, nodes: int, retention_defaults: dict, taken: Callable[[str], bool],
           internal: bool = False) -> tuple[str, dict]:
    """One spec's name and shape, defaults filled in (``retention_defaults``: the cluster's);
    refused if invalid, ``taken`` or too large for ``nodes`` live nodes. ``internal``: one of
    kera's own streams, whose name a user's cannot be."""
    if not isinstance(spec, dict):
        raise InvalidArgument("a stream spec must be a map")
    name = spec["name"] if internal else check_stream_name(spec.get("name"))
    if taken(name):
        raise StreamExists(f"stream {name!r} exists")
    cfg = {}
    for key, default in DEFAULTS.items():
        v = spec.get(key)
        v = default if v is None else v
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidArgument(f"{key} must be a positive integer")
        cfg[key] = v
    check_limits(cfg)
    policy = spec.get("vlogs")
    if policy is not None and policy not in VLOG_POLICIES:
        raise InvalidArgument(f"vlogs must be one of {', '.join(VLOG_POLICIES)}")
    cfg["vlogs"] = policy
    cfg.update({**retention_defaults, **retention(spec)})
    cfg.update({"cleanup_policy": "delete", **cleanup_policy(spec, cfg["groups"])})
    if spec.get("replication") is None:
        cfg["replication"] = min(cfg["replication"], max(1, nodes))
    if cfg["replication"] > nodes:
        raise NotEnoughBackups(
            f"replication {cfg['replication']} needs {cfg['replication']} nodes, {nodes} alive")
    return name, cfg
