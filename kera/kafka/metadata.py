"""Metadata, CreateTopics, DeleteTopics, DescribeConfigs: the coordinator's view, in Kafka's terms.

A topic is a stream, its partitions the streamlets, each led by the broker owning it (its
Kafka listener registered with the coordinator). A streamlet being recovered has no
leader (``LEADER_NOT_AVAILABLE``, retriable); after a move a client's produce or fetch is
told ``NOT_LEADER_OR_FOLLOWER`` and it asks for metadata again. kera's copies are its
backups, not brokers: each partition lists its leader as its only replica and in-sync
replica. A topic is created with one active group per streamlet (Kafka's one log per
partition), its partition count (-1: 1) and replication factor (-1: the cluster's
default), and the retention and cleanup configs kera has, under Kafka's names.
"""

from __future__ import annotations

import trio
from kio.schema.errors import ErrorCode

from ..errors import KeraError
from . import codes

CONFIGS = ("retention.ms", "retention.bytes", "cleanup.policy", "delete.retention.ms", "segment.ms")
TOPIC, BROKER = 2, 4          # DescribeConfigs resource types
PAGE = 1024


def handlers(gw) -> dict:
    return {"metadata": lambda c, r, v: _metadata(gw, c, r, v),
            "create_topics": lambda c, r, v: _create_topics(gw, c, r, v),
            "delete_topics": lambda c, r, v: _delete_topics(gw, c, r, v),
            "describe_configs": lambda c, r, v: _describe_configs(gw, c, r, v)}


async def streams(gw, names: list[str] | None) -> tuple[dict, dict, list]:
    """(name -> stream map, broker id -> Kafka address, missing names) from the
    coordinator: the ``names``, or every stream (page by page) for None."""
    out, missing, kafka = {}, [], {}
    if names is not None:
        for i in range(0, len(names), PAGE):
            r = await gw.coordinator("metadata", {"names": names[i:i + PAGE]})
            kafka.update(r.get("kafka") or {})
            missing += r.get("missing") or []
            out.update((s["name"], s) for s in r["streams"])
        if not names:
            r = await gw.coordinator("metadata", {"names": []})
            kafka.update(r.get("kafka") or {})
        return out, kafka, missing
    after = None
    while True:
        r = await gw.coordinator("metadata", {"pattern": "*", **({"after": after} if after else {})})
        kafka.update(r.get("kafka") or {})
        out.update((s["name"], s) for s in r["streams"])
        after = r.get("next")
        if after is None:
            return out, kafka, missing


def _partitions(s: dict, kafka: dict) -> list[dict]:
    out = []
    for i, ((b, _), addr) in enumerate(zip(s["owners"], s["addrs"], strict=True)):
        leader = b if addr is not None and b in kafka else -1
        out.append({"error_code": ErrorCode.none if leader >= 0 else ErrorCode.leader_not_available,
                    "partition_index": i, "leader_id": leader, "leader_epoch": -1,
                    "replica_nodes": (leader,) if leader >= 0 else (),
                    "isr_nodes": (leader,) if leader >= 0 else (), "offline_replicas": ()})
    return out


async def _metadata(gw, conn, req, version):
    peer = conn.peer
    names = None if req.topics is None else [t.name for t in req.topics if t.name]
    auto = gw.auto_create and getattr(req, "allow_auto_topic_creation", True)
    found, kafka, missing = await streams(gw, names)
    created = []
    if auto and missing:
        creatable = [n for n in missing if peer.may("create", "stream", n)]
        created = await _create(gw, [{"name": n, "streamlets": 1, "groups": 1} for n in creatable])
        if any(code == ErrorCode.none for _, code, _ in created):
            more, kafka2, missing = await streams(gw, missing)
            found.update(more)
            kafka.update(kafka2)
    topics = []
    for name, s in found.items():
        if not peer.may("describe", "stream", name):
            if names is not None:
                topics.append({"error_code": ErrorCode.topic_authorization_failed, "name": name,
                               "partitions": ()})
            continue
        topics.append({"error_code": ErrorCode.none, "name": name, "is_internal": False,
                       "partitions": _partitions(s, kafka)})
    for name in missing:
        topics.append({"error_code": ErrorCode.unknown_topic_or_partition, "name": name,
                       "partitions": ()})
    brokers = []
    for bid, addr in sorted(kafka.items()):
        host, _, port = addr.rpartition(":")
        brokers.append({"node_id": int(bid), "host": host.strip("[]"), "port": int(port)})
    return {"throttle_time": 0, "brokers": brokers, "cluster_id": "kera",
            "controller_id": min(kafka) if kafka else -1, "topics": topics}


def _spec(t) -> tuple[dict, str | None]:
    """A CreatableTopic as a stream spec (its configs under Kafka's names), or why not."""
    spec = {"name": t.name, "groups": 1,
            "streamlets": 1 if t.num_partitions == -1 else int(t.num_partitions)}
    if t.replication_factor != -1:
        spec["replication"] = int(t.replication_factor)
    if t.assignments:
        return spec, "replica assignments are kera's to make"
    for c in t.configs:
        if c.name not in CONFIGS:
            return spec, f"config {c.name} is not one kera has ({', '.join(CONFIGS)})"
        v = c.value
        spec[c.name] = v if c.name == "cleanup.policy" else int(v) if v is not None else None
    return spec, None


async def _create(gw, specs: list[dict]) -> list[tuple[str, ErrorCode, str | None]]:
    """Create each stream on its own (Kafka answers per topic), all at once."""
    out: list = [None] * len(specs)

    async def one(i, spec):
        try:
            await gw.coordinator("create_stream", spec)
            out[i] = (spec["name"], ErrorCode.none, None)
        except KeraError as e:
            code = codes.of(e)
            if e.code == "not_enough_backups":
                code = ErrorCode.invalid_replication_factor
            elif e.code in ("invalid_argument", "limit_exceeded") and "streamlets" in str(e):
                code = ErrorCode.invalid_partitions
            elif e.code in ("invalid_argument", "limit_exceeded"):
                code = ErrorCode.invalid_config
            out[i] = (spec["name"], code, str(e))

    async with trio.open_nursery() as n:
        for i, spec in enumerate(specs):
            n.start_soon(one, i, spec)
    return out


async def _create_topics(gw, conn, req, version):
    results, todo = [], []
    for t in req.topics:
        spec, why = _spec(t)
        if not conn.peer.may("create", "stream", t.name):
            results.append((t.name, ErrorCode.topic_authorization_failed, None))
        elif why is not None:
            results.append((t.name, ErrorCode.invalid_request, why))
        elif not req.validate_only:
            todo.append(spec)
        else:
            results.append((t.name, ErrorCode.none, None))
    results += await _create(gw, todo)
    parts = {t.name: (t.num_partitions, t.replication_factor) for t in req.topics}
    return {"throttle_time": 0, "topics": [
        {"name": name, "error_code": code, "error_message": msg,
         "num_partitions": parts[name][0], "replication_factor": parts[name][1], "configs": ()}
        for name, code, msg in results]}


async def _delete_topics(gw, conn, req, version):
    names = list(getattr(req, "topic_names", None) or [t.name for t in getattr(req, "topics", ())])
    out: list = [None] * len(names)

    async def one(i, name):
        if not conn.peer.may("delete", "stream", name):
            out[i] = {"name": name, "error_code": ErrorCode.topic_authorization_failed}
            return
        try:
            await gw.coordinator("delete_stream", {"name": name})
            out[i] = {"name": name, "error_code": ErrorCode.none}
        except KeraError as e:
            out[i] = {"name": name, "error_code": codes.of(e), "error_message": str(e)}

    async with trio.open_nursery() as n:
        for i, name in enumerate(names):
            n.start_soon(one, i, name)
    return {"throttle_time": 0, "responses": out}


def _config_values(s: dict) -> dict:
    def unset(v):
        return "-1" if v is None else str(v)
    return {"retention.ms": str(s.get("retention_ms", -1)),
            "retention.bytes": str(s.get("retention_bytes", -1)),
            "cleanup.policy": s.get("cleanup_policy", "delete"),
            "delete.retention.ms": unset(s.get("delete_retention_ms", 86_400_000)),
            "segment.ms": unset(s.get("segment_ms", 60_000))}


async def _describe_configs(gw, conn, req, version):
    results = []
    for r in req.resources:
        res = {"resource_type": r.resource_type, "resource_name": r.resource_name,
               "error_code": ErrorCode.none, "configs": ()}
        if r.resource_type == TOPIC:
            if not conn.peer.may("describe-configs", "stream", r.resource_name) and \
                    not conn.peer.may("describe", "stream", r.resource_name):
                res["error_code"] = ErrorCode.topic_authorization_failed
            else:
                try:
                    s = (await gw.coordinator("describe_stream", {"name": r.resource_name}))["stream"]
                    keys = r.configuration_keys
                    res["configs"] = [{"name": k, "value": v, "read_only": False, "config_source": 5}
                                      for k, v in _config_values(s).items() if keys is None or k in keys]
                except KeraError as e:
                    res["error_code"], res["error_message"] = codes.of(e), str(e)
        results.append(res)
    return {"throttle_time": 0, "results": results}
