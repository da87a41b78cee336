"""What the rebuilder takes from a surviving copy: only the vseg's own chunks, at their offsets."""

from __future__ import annotations

import pytest

from kera import chunk
from kera.broker.rebuild import Rebuilder
from kera.errors import ChecksumError, ProtocolError
from kera.vlog.virtual_segment import VirtualSegment


def _vseg(chunks: list[bytes]) -> VirtualSegment:
    vs = VirtualSegment(0, 1 << 20)
    for c in chunks:
        vs.add(None, 0, len(c), chunk.parse_header(memoryview(c)).body_checksum)
    vs.closed = vs.frozen = True
    return vs


def _chunks() -> list[bytes]:
    return [chunk.build(1, 0, 7, q, [b"v%d" % q * (q + 1)], timestamps=0) for q in range(4)]


def test_the_chunks_appended_there_pass():
    cs = _chunks()
    vs = _vseg(cs)
    Rebuilder._check(vs, 0, memoryview(b"".join(cs)))
    at = len(cs[0]) + len(cs[1])
    Rebuilder._check(vs, at, memoryview(b"".join(cs[2:])))


@pytest.mark.parametrize("case", ["other chunk", "not a boundary", "past the end", "damaged"])
def test_anything_else_is_refused(case):
    cs = _chunks()
    vs = _vseg(cs)
    other = chunk.build(1, 0, 7, 9, [b"not ours"], timestamps=0)
    off, data = {
        "other chunk": (len(cs[0]), other + b"".join(cs[2:])),
        "not a boundary": (1, b"".join(cs[1:])),
        "past the end": (0, b"".join(cs) + cs[0]),
        "damaged": (0, b"".join(cs)[:-1] + bytes([cs[-1][-1] ^ 0xFF])),
    }[case]
    with pytest.raises((ChecksumError, ProtocolError)):
        Rebuilder._check(vs, off, memoryview(data))
