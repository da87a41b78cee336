"""Vectored writes (``sendmsg``, ``pwritev``): a list of buffers out without joining them.

Both calls take at most ``IOV_MAX`` buffers and may write fewer bytes than asked; the
caller resends from where the last call stopped (``advance``).
"""

from __future__ import annotations

IOV_MAX = 1024  # Linux' limit on buffers per sendmsg / pwritev call


def views(parts) -> list[memoryview]:
    """The non-empty parts as byte views (an empty one would make a call write nothing
    and the resend loop spin)."""
    return [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]


def advance(vs: list[memoryview], i: int, n: int) -> int:
    """``n`` bytes of ``vs[i:]`` were written: the index of the first buffer not fully
    written, whose view is cut to what is left of it."""
    while n:
        size = vs[i].nbytes
        if n >= size:
            n -= size
            i += 1
        else:
            vs[i] = vs[i][n:]
            n = 0
    return i
