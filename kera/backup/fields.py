"""Request fields every backup RPC checks the same way (shared by ``service``,
``readback`` and ``release``): a bad one is an ``InvalidArgument`` naming it."""

from __future__ import annotations

from ..errors import InvalidArgument
from .store import Key

U63 = 1 << 63


def uint(meta: dict, name: str, default: int | None = None) -> int:
    v = meta.get(name, default)
    if type(v) is not int or not 0 <= v < U63:
        raise InvalidArgument(f"{name!r} must be an integer in [0, 2^63), not {v!r}")
    return v


def vseg_key(meta: dict) -> Key:
    return (uint(meta, "broker"), uint(meta, "vlog"), uint(meta, "vseg"))
