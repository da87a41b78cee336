"""The replica a backup request names. Every field's type and bounds are the wire table's
(``kera.wire``), checked before a handler runs: this only picks them out."""

from __future__ import annotations

from .store import Key


def vseg_key(meta: dict) -> Key:
    return (meta["broker"], meta["vlog"], meta["vseg"])
