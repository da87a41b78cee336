"""Re-pointing decisions and the index chunk format (pure, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from kera import chunk, index_chunk
from kera.errors import ProtocolError
from kera.repoint_plan import Row, plan_repoint


def rows_of(vseg: int, group: int, segment: int, sizes, at: int = 0, flags: int = 0) -> list[Row]:
    out, off = [], 0
    for i, n in enumerate(sizes):
        out.append(Row(1, vseg, at + off, n, 7, 0, group, segment, off, 3, segment * 10 + i, flags))
        off += n
    return out


def test_index_chunks_are_repointed_first_then_whole_segments_but_never_the_last():
    rows = (rows_of(0, 0, 0, [300], flags=chunk.INDEX) + rows_of(0, 0, 1, [300], 300, chunk.INDEX)
            + rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + rows_of(2, 0, 4, [80]))
    rp = plan_repoint(rows, {1: [0, 1, 2]})
    assert [(a.segment, a.indexed) for a in rp.adopted] == [(0, True), (1, True), (2, False), (3, False)]
    assert rp.replay_from == {(7, 0, 0): 4}
    assert rp.bytes == 250                       # index chunks' segments are counted by the caller
    assert rp.skip == {1: {0, 1}}                # vseg 2 holds segment 4, which is replayed


def test_an_index_chunk_is_repointed_even_as_the_last_segment_listed():
    rp = plan_repoint(rows_of(0, 2, 5, [300], flags=chunk.INDEX), {1: [0]})
    assert [(a.group, a.segment) for a in rp.adopted] == [(2, 5)]
    assert rp.replay_from == {(7, 0, 2): 6}


def test_index_chunk_round_trip_and_bad_input():
    rows = np.array([[100, 3, 0, 7, 1], [250, 4, 0, 9, 5]], "<u8")
    ix = index_chunk.SegmentIndex(5, 1, 2, 3, 8, (2 << 32) | 1, rows, {3: [1, 2], 4: [2]})
    data = index_chunk.build(ix)
    h = chunk.verify(data)
    assert (h.flags, h.group, h.segment, h.offset, h.producer_id) == (chunk.INDEX, 2, 3, 0, 7)
    back = index_chunk.parse(data, h)
    assert (back.source, back.vlog, back.copies, back.head) == (8, (2 << 32) | 1, {3: [1, 2], 4: [2]}, 250)
    assert back.producers() == {7: 1, 9: 5} and (back.rows == rows).all()
    with pytest.raises(ProtocolError):  # records, not an index
        index_chunk.parse(chunk.build(5, 1, 7, 0, [b"x" * 48]))
    with pytest.raises(ProtocolError):  # flagged, but its value is no index
        index_chunk.parse(chunk.build(5, 1, 7, 0, [b"x" * 48], flags=chunk.INDEX))
    bad = index_chunk.SegmentIndex(5, 1, 2, 3, 8, 1, rows, {3: [1]})  # no copies of vseg 4
    with pytest.raises(ProtocolError):
        index_chunk.parse(index_chunk.build(bad))
