"""Producer options: the defaults, and the one check every producer's configuration passes.

Kept apart so ``open_producer`` and the synchronous ``Producer`` refuse a bad
option the same way, before any connection is opened.
"""

from __future__ import annotations

import numbers

from kera.security.client_config import KEYS as SECURITY

DEFAULTS = {
    "acks": "all",
    "linger.ms": 5.0,
    "chunk.size": 16384,
    "request.size": 1 << 20,
    "max.in.flight": 4,
    "partitioner": "key",
    "buffer.memory": 256 << 20,
    "delivery.timeout.ms": 120_000,
    "request.timeout.ms": 30_000,
}


def producer_config(config: dict | None, kw: dict) -> dict:
    """The options of ``config`` and ``kw`` (``linger_ms`` stands for ``linger.ms``) over
    ``DEFAULTS``; ValueError for an unknown option or a bad value. Security settings
    (``security.protocol``, ``sasl.*``, ``ssl.*``) are the pool's, not the producer's."""
    cfg = dict(DEFAULTS)
    for src in (config or {}), kw:
        for k, v in src.items():
            if k in SECURITY:
                continue
            k = k.replace("_", ".")
            if k not in cfg:
                raise ValueError(f"unknown producer option {k!r}; known: {', '.join(cfg)}")
            cfg[k] = v
    for k in ("chunk.size", "request.size", "max.in.flight", "buffer.memory"):
        if not isinstance(cfg[k], numbers.Integral) or cfg[k] < 1:
            raise ValueError(f"{k} must be a positive integer, not {cfg[k]!r}")
    if cfg["acks"] not in ("all", "leader", "none"):
        raise ValueError("acks must be all, leader or none")
    if cfg["partitioner"] not in ("key", "round-robin"):
        raise ValueError("partitioner must be key (default: a record's key hash picks its streamlet, "
                         "records without key go sticky round-robin) or round-robin (keys ignored)")
    return cfg
