"""The Kafka APIs kera serves, the versions of each, and their kio codecs.

Only the APIs in ``SUPPORTED`` are listed by ApiVersions; a request for another API, or
for a version out of range, is answered ``UNSUPPORTED_VERSION`` (never a hang or a
dropped connection: the client learns at once). The ranges stop where Kafka's schemas
start naming topics by id instead of by name (Fetch 13, Produce 13, DeleteTopics 6),
which kera's streams, named, do not need.

``make(cls, **values)`` builds a request or response entity of any version from the
values a handler computed, nested entities given as dicts: a field a version lacks is
left out, one it has and was not given gets its zero value, so one handler serves every
version of its API.
"""

from __future__ import annotations

import datetime
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from functools import cache

from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

# api key -> (name, min version, max version)
SUPPORTED: dict[int, tuple[str, int, int]] = {
    0: ("produce", 3, 9),
    1: ("fetch", 4, 12),
    2: ("list_offsets", 1, 7),
    3: ("metadata", 1, 12),
    8: ("offset_commit", 2, 8),
    9: ("offset_fetch", 1, 7),
    10: ("find_coordinator", 0, 3),
    11: ("join_group", 0, 7),
    12: ("heartbeat", 0, 4),
    13: ("leave_group", 0, 4),
    14: ("sync_group", 0, 5),
    15: ("describe_groups", 0, 5),
    16: ("list_groups", 0, 4),
    17: ("sasl_handshake", 0, 1),
    18: ("api_versions", 0, 3),
    19: ("create_topics", 2, 5),
    20: ("delete_topics", 1, 5),
    22: ("init_producer_id", 0, 4),
    32: ("describe_configs", 1, 4),
    36: ("sasl_authenticate", 0, 2),
}
API_VERSIONS = 18
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def supported(api_key: int, version: int) -> bool:
    s = SUPPORTED.get(api_key)
    return s is not None and s[1] <= version <= s[2]


@cache
def request_class(api_key: int, version: int):
    return load_request_schema(api_key, version)


@cache
def response_class(api_key: int, version: int):
    return load_response_schema(api_key, version)


@cache
def reader(cls):
    return entity_reader(cls)


@cache
def writer(cls):
    return entity_writer(cls)


def flexible(api_key: int, version: int) -> bool:
    return request_class(api_key, version).__flexible__


def flexible_response_header(api_key: int, version: int) -> bool:
    """Whether the response header is v1 (tagged fields); ApiVersions' never is."""
    return response_class(api_key, version).__header_schema__.__version__ >= 1


@cache
def _nested(cls) -> dict[str, tuple[type | None, bool]]:
    """Field name -> (the entity type of a nested or nested tuple field or None, whether it
    is a single entity)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        t = hints[f.name]
        e = _entity_of(t)
        out[f.name] = (e, e is not None and typing.get_origin(t) is not tuple)
    return out


def _entity_of(t):
    origin = typing.get_origin(t)
    if origin in (tuple, typing.Union, types.UnionType):
        for a in typing.get_args(t):
            e = _entity_of(a)
            if e is not None:
                return e
        return None
    return t if is_dataclass(t) else None


def _zero(f):
    kind = f.metadata.get("kafka_type")
    if kind in ("timedelta_i32", "timedelta_i64"):
        return datetime.timedelta(0)
    if kind == "error_code":
        return ErrorCode.none
    if kind in ("string",):
        return ""
    if kind in ("bool",):
        return False
    if kind == "uuid":
        return None
    if kind is None:          # an array of entities or a nested entity
        return ()
    return 0


def _value(f, v, nested):
    kind = f.metadata.get("kafka_type")
    if kind in ("timedelta_i32", "timedelta_i64") and isinstance(v, int):
        return datetime.timedelta(milliseconds=v)
    if kind == "datetime_i64" and isinstance(v, int):
        return EPOCH + datetime.timedelta(milliseconds=v)
    if kind == "error_code" and isinstance(v, int) and not isinstance(v, ErrorCode):
        return ErrorCode(v)
    if nested is not None:
        if isinstance(v, dict):
            return make(nested, **v)
        if isinstance(v, (list, tuple)):
            return tuple(make(nested, **x) if isinstance(x, dict) else x for x in v)
    return v


def make(cls, **values):
    """An entity of ``cls`` from ``values`` (see the module doc)."""
    nested = _nested(cls)
    kw = {}
    for f in fields(cls):
        if f.name in values:
            kw[f.name] = _value(f, values[f.name], nested[f.name][0])
        elif f.default is MISSING and f.default_factory is MISSING:
            e, single = nested[f.name]
            kw[f.name] = make(e) if single else _zero(f)
    return cls(**kw)


def api_versions_body(version: int, error: ErrorCode = ErrorCode.none):
    """The ApiVersions response of ``version`` listing ``SUPPORTED``."""
    keys = [{"api_key": k, "min_version": lo, "max_version": hi}
            for k, (_, lo, hi) in sorted(SUPPORTED.items())]
    return make(response_class(API_VERSIONS, version), error_code=error, api_keys=keys,
                throttle_time=0)
