"""A linearizability checker for histories of a key-value map.

Wing & Gong's search with Lowe's memoisation (as in Lowe, "Testing for
linearizability", 2017, and the porcupine and Knossos checkers): walk the
history's invocation/response events in time order; at an invocation, try to
linearize that operation now (apply it to the sequential model; its recorded
result must match) and remove it; at a response whose operation is not yet
linearized, undo the last choice. A (linearized set, model state) pair seen
before is not explored again. A map is a product of independent registers,
so each key's sub-history is checked on its own (P-compositionality), which
keeps the search small.

An operation that timed out (``done`` None) may or may not have taken effect:
its response is at infinity and its result unconstrained, so it can be
linearized anywhere after its invocation or, in effect, never (after
everything else).

Operations: ``Op(process, kind, key, arg, start, done, result)`` with kind
``put`` (arg value, result the new version), ``get`` (result value or None),
``cas`` (arg (expected version, value), result bool), ``delete`` (result bool).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Op:
    process: int
    kind: str
    key: str
    arg: object
    start: float
    done: float | None   # None: no answer (timeout, crash): outcome unknown
    result: object = None


def step(state, op: Op):
    """(ok, next state) of the sequential map register: state None or (version, value)."""
    version = state[0] if state else 0
    unknown = op.done is None
    if op.kind == "get":
        return unknown or op.result == (state[1] if state else None), state
    if op.kind == "put":
        return unknown or op.result == version + 1, (version + 1, op.arg)
    if op.kind == "cas":
        expected, value = op.arg
        hit = expected == version
        return unknown or op.result == hit, ((version + 1, value) if hit else state)
    if op.kind == "delete":
        return unknown or op.result == (state is not None), None
    raise ValueError(f"unknown operation {op.kind!r}")


class _Entry:
    __slots__ = ("op", "index", "call", "match", "prev", "next")

    def __init__(self, op, index, call):
        self.op, self.index, self.call = op, index, call
        self.match = self.prev = self.next = None


def _events(ops: list[Op]) -> _Entry:
    """A doubly linked list of call/return events in time order (calls first on ties)."""
    evs = []
    for i, op in enumerate(ops):
        c, r = _Entry(op, i, True), _Entry(op, i, False)
        c.match = r
        evs.append((op.start, 0, c))
        evs.append((math.inf if op.done is None else op.done, 1, r))
    evs.sort(key=lambda e: (e[0], e[1]))
    head = _Entry(None, -1, False)
    prev = head
    for _, _, e in evs:
        prev.next, e.prev = e, prev
        prev = e
    return head


def _lift(e: _Entry) -> None:
    e.prev.next = e.next
    if e.next:
        e.next.prev = e.prev
    r = e.match
    r.prev.next = r.next
    if r.next:
        r.next.prev = r.prev


def _unlift(e: _Entry) -> None:
    r = e.match
    r.prev.next = r
    if r.next:
        r.next.prev = r
    e.prev.next = e
    if e.next:
        e.next.prev = e


def check_register(ops: list[Op], initial=None) -> bool:
    """Whether one key's history is linearizable."""
    head = _events(ops)
    remaining = sum(op.done is not None for op in ops)   # answered ops still to place
    state, done_bits = initial, 0
    stack: list[tuple[_Entry, object]] = []
    seen: set[tuple[int, object]] = set()
    e = head.next
    while remaining:
        if e is None:
            return False
        if e.call:
            ok, nxt = step(state, e.op)
            bits = done_bits | (1 << e.index)
            if ok and (bits, nxt) not in seen:
                seen.add((bits, nxt))
                stack.append((e, state))
                state, done_bits = nxt, bits
                remaining -= e.op.done is not None
                _lift(e)
                e = head.next
            else:
                e = e.next
        else:   # an answered op's response, and it is not placed yet: undo the last choice
            if not stack:
                return False
            e, state = stack.pop()
            done_bits &= ~(1 << e.index)
            remaining += e.op.done is not None
            _unlift(e)
            e = e.next
    return True


def check(ops: list[Op]) -> list[str]:
    """The keys whose sub-histories are not linearizable (empty: the history is)."""
    by_key: dict[str, list[Op]] = {}
    for op in ops:
        by_key.setdefault(op.key, []).append(op)
    return sorted(k for k, sub in by_key.items() if not check_register(sub))
