"""The wire's field types: what a request's field may be, checked before a handler runs.

A ``Spec`` says whether a value fits (``ok``: fast, no allocation on the common path) and
what fits (``text``, for the error); ``check`` raises the typed error: ``LimitExceeded``
naming the limit for a list too long or a count too large that a limit bounds,
``InvalidArgument`` naming the field otherwise. Fields are named ``name`` (required) or
``name?`` (optional: absent or None).
"""

from __future__ import annotations

import re

from ..errors import InvalidArgument, LimitExceeded
from ..names import MAX_NAME

U63 = 1 << 63


class Spec:
    """One field's type and bounds: ``ok(v)`` says if ``v`` fits; ``text`` says what fits."""

    text = "?"

    def ok(self, v) -> bool:
        raise NotImplementedError

    def check(self, v, where: str) -> None:
        if not self.ok(v):
            raise InvalidArgument(f"{where} must be {self.text}, not {v!r:.80}")


class _UInt(Spec):
    def __init__(self, high: int = U63 - 1, limit: str = "", low: int = 0):
        self.low, self.high, self.limit = low, high, limit
        self.text = f"an integer >= {low}" if high == U63 - 1 else f"an integer in [{low}, {high}]"

    def ok(self, v) -> bool:
        return type(v) is int and self.low <= v <= self.high

    def check(self, v, where: str) -> None:
        if self.limit and type(v) is int and v > self.high:
            raise LimitExceeded(f"{where} {v} exceeds {self.limit} ({self.high})", limit=self.limit,
                                bound=self.high, size=v)
        super().check(v, where)


class _Int(Spec):
    text = "an integer"

    def ok(self, v) -> bool:
        return type(v) is int and -U63 <= v < U63


class _Number(Spec):
    text = "a number"

    def ok(self, v) -> bool:
        return type(v) is int or type(v) is float


class _Bool(Spec):
    text = "true or false"

    def ok(self, v) -> bool:
        return type(v) is bool


class Str(Spec):
    def __init__(self, most: int = MAX_NAME, least: int = 0):
        self.least, self.most = least, most
        self.text = f"a string of {least} to {most} characters"

    def ok(self, v) -> bool:
        return type(v) is str and self.least <= len(v) <= self.most


class Bytes(Spec):
    def __init__(self, most: int):
        self.most = most
        self.text = f"bytes, at most {most}"

    def ok(self, v) -> bool:
        return type(v) is bytes and len(v) <= self.most


class OneOf(Spec):
    def __init__(self, *values):
        self.values = frozenset(values)
        self.text = "one of " + ", ".join(map(repr, values))

    def ok(self, v) -> bool:
        return type(v) in (str, int) and v in self.values


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]")


class _Addr(Spec):
    """HOST:PORT another process can connect to (a name or an IP, a port in 1..65535)."""

    text = "HOST:PORT (a host name or IP address, a port in 1..65535)"

    def ok(self, v) -> bool:
        if type(v) is not str or len(v) > 261:
            return False
        host, _, port = v.rpartition(":")
        return (port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536
                and _HOST.fullmatch(host) is not None)


class ListOf(Spec):
    def __init__(self, item: Spec, most: int, least: int = 0, limit: str = ""):
        self.item, self.least, self.most, self.limit = item, least, most, limit
        self.text = f"a list of {least} to {most} of {item.text}"

    def ok(self, v) -> bool:
        return type(v) is list and self.least <= len(v) <= self.most and all(map(self.item.ok, v))

    def check(self, v, where: str) -> None:
        if type(v) is list and len(v) > self.most and self.limit:
            raise LimitExceeded(f"{where}: {len(v)} entries exceed {self.limit} ({self.most})",
                                limit=self.limit, bound=self.most, size=len(v))
        if type(v) is not list or not self.least <= len(v) <= self.most:
            raise InvalidArgument(f"{where} must be {self.text}, not {v!r:.80}")
        ok = self.item.ok
        for i, x in enumerate(v):
            if not ok(x):
                self.item.check(x, f"{where}[{i}]")


class Tuple(Spec):
    """A list of fixed shape; with ``least``, its last items may be left out."""

    def __init__(self, *items: Spec, least: int | None = None):
        self.items = items
        self.least = len(items) if least is None else least
        self.text = "[" + ", ".join(i.text for i in items) + "]"

    def ok(self, v) -> bool:
        if type(v) is not list or not self.least <= len(v) <= len(self.items):
            return False
        for s, x in zip(self.items, v, strict=False):   # a loop: a generator costs more than
            if not s.ok(x):                             # the two or three items it looks at
                return False
        return True


class MapOf(Spec):
    def __init__(self, key: Spec, value: Spec, most: int):
        self.key, self.value, self.most = key, value, most
        self.text = f"a map of at most {most} {key.text} to {value.text}"
        # keys and values of any type: nothing to look at in them (a recovery's assign
        # carries 333,333 stream maps, each walked item by item for nothing)
        self.opaque = isinstance(key, _Any) and isinstance(value, _Any)

    def ok(self, v) -> bool:
        return type(v) is dict and len(v) <= self.most and (self.opaque or all(
            self.key.ok(k) and self.value.ok(x) for k, x in v.items()))


class Struct(Spec):
    """A map with these fields (``name?`` optional); others are allowed when ``extra``."""

    def __init__(self, fields: dict, extra: bool = False):
        self.fields = field_specs(fields)
        self.names = frozenset(n for n, _, _ in self.fields)
        self.extra = extra
        self.text = "{" + ", ".join(fields) + ("..." if extra else "") + "}"

    def ok(self, v) -> bool:
        if type(v) is not dict:
            return False
        for name, spec, required in self.fields:
            x = v.get(name)
            if x is None:
                if required:
                    return False
            elif not spec.ok(x):
                return False
        return self.extra or v.keys() <= self.names


class Nullable(Spec):
    def __init__(self, spec: Spec):
        self.spec = spec
        self.text = f"null or {spec.text}"

    def ok(self, v) -> bool:
        return v is None or self.spec.ok(v)


class _Any(Spec):
    text = "any value"

    def ok(self, v) -> bool:
        return True


UINT, INT, NUMBER, BOOL, ADDR, ANY = _UInt(), _Int(), _Number(), _Bool(), _Addr(), _Any()
MAP = MapOf(ANY, ANY, 1 << 20)
NAME = Str(MAX_NAME, 1)
U32 = _UInt((1 << 32) - 1)


def UInt(high: int, limit: str = "", low: int = 0) -> Spec:   # noqa: N802 (a type, as the others)
    return _UInt(high, limit, low)


def field_specs(fields: dict) -> list[tuple[str, Spec, bool]]:
    """(name, its spec, whether it is required) of each of ``fields`` (``name?``: optional)."""
    return [(k.rstrip("?"), s, not k.endswith("?")) for k, s in fields.items()]
