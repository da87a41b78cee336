"""Re-pointing decisions and the index chunk format (pure, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from kera import chunk
from kera.errors import InvalidArgument, ProtocolError
from kera.recovery import index_chunk
from kera.recovery.repoint_plan import COLUMNS, plan_repoint


def rows_of(vseg: int, group: int, segment: int, sizes, at: int = 0, flags: int = 0) -> list[tuple]:
    """Index rows (see ``kera.repoint_plan``'s columns) of one segment's chunks in one vseg of vlog 1."""
    out, off = [], 0
    for i, n in enumerate(sizes):
        out.append((1, vseg, at + off, n, 7, 0, group, segment, off, 3, segment * 10 + i, flags, 0, 1, segment, 1))
        off += n
    return out


def close_row(vseg: int, group: int, segment: int, offset: int, at: int) -> list[tuple]:
    """A group's close chunk, as the index lists it."""
    return [(1, vseg, at, 120, 7, 0, group, segment, offset, 3, 0, chunk.CLOSE, 0, 1, segment, 1)]


def plan(rows, settled, **kw):
    """``plan_repoint`` over the rows in an array shuffled out of vlog order (the plan sorts)."""
    a = np.array(rows, np.uint64).reshape(-1, COLUMNS)
    return plan_repoint(a[np.random.default_rng(1).permutation(len(a))], settled, **kw)


def test_index_chunks_are_repointed_first_then_whole_segments_but_never_the_last():
    rows = (rows_of(0, 0, 0, [300], flags=chunk.INDEX) + rows_of(0, 0, 1, [300], 300, chunk.INDEX)
            + rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + rows_of(2, 0, 4, [80]))
    rp = plan(rows, {1: [0, 1, 2]})
    assert [(a.segment, a.indexed) for a in rp.adopted] == [(0, True), (1, True), (2, False), (3, False)]
    assert rp.replay_from == {(7, 0, 0): 4}
    assert rp.bytes == 250                       # index chunks' segments are counted by the caller
    assert rp.skip == {1: {0, 1}}                # vseg 2 holds segment 4, which is replayed


def test_an_index_chunk_is_repointed_even_as_the_last_segment_listed():
    rp = plan(rows_of(0, 2, 5, [300], flags=chunk.INDEX), {1: [0]})
    assert [(a.group, a.segment) for a in rp.adopted] == [(2, 5)]
    assert rp.replay_from == {(7, 0, 2): 6}


def test_index_chunk_round_trip_and_bad_input():
    rows = np.array([[100, 3, 0, 7, 1, 11, 4], [250, 4, 0, 9, 5, 15, 6]], "<u8")  # Kafka 10.., 14..
    ix = index_chunk.SegmentIndex(5, 1, 2, 3, 8, (2 << 32) | 1, rows, {3: [1, 2], 4: [2]})
    data = index_chunk.build(ix)
    h = chunk.verify(data)
    assert (h.flags, h.group, h.segment, h.offset, h.producer_id) == (chunk.INDEX, 2, 3, 0, 7)
    back = index_chunk.parse(data, h)
    assert (back.source, back.vlog, back.copies, back.head) == (8, (2 << 32) | 1, {3: [1, 2], 4: [2]}, 250)
    assert back.producers() == {7: 1, 9: 5} and (back.rows == rows).all()
    old = index_chunk.SegmentIndex(5, 1, 2, 3, 8, 1, rows[:, :5].copy(), {3: [1, 2], 4: [2]})
    assert (index_chunk.parse(index_chunk.build(old)).rows[:, 5:] == 0).all()  # offsets unknown
    closed = index_chunk.build(ix, closed=True)  # a closed group's last segment
    h = chunk.verify(closed)
    assert h.flags == chunk.INDEX | chunk.CLOSE and index_chunk.parse(closed, h).head == 250
    with pytest.raises(ProtocolError):  # records, not an index
        index_chunk.parse(chunk.build(5, 1, 7, 0, [b"x" * 48]))
    with pytest.raises(ProtocolError):  # flagged, but its value is no index
        index_chunk.parse(chunk.build(5, 1, 7, 0, [b"x" * 48], flags=chunk.INDEX))
    bad = index_chunk.SegmentIndex(5, 1, 2, 3, 8, 1, rows, {3: [1]})  # no copies of vseg 4
    with pytest.raises(ProtocolError):
        index_chunk.parse(index_chunk.build(bad))


def test_a_streamlet_replayed_whole_adopts_nothing_and_keeps_its_vsegs_replayed():
    rows = rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + rows_of(2, 0, 4, [80])
    rp = plan(rows, {1: [1, 2]}, replayed=frozenset({(7, 0)}))
    assert rp.adopted == [] and rp.replay_from == {} and rp.skip == {}


def test_a_closed_groups_last_segment_is_repointed_when_its_close_chunk_names_its_head():
    seg = rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50, 30], 200)   # head of segment 3: 80
    rp = plan(seg + close_row(2, 0, 3, 80, 0) + rows_of(2, 1, 0, [40], 120), {1: [1, 2]})
    assert [(a.segment, a.closed, a.indexed) for a in rp.adopted] == [(2, False, False), (3, True, False)]
    assert rp.replay_from == {(7, 0, 0): 4} and rp.bytes == 280
    assert rp.skip == {1: {1}}   # vseg 2 holds group 1's chunk, replayed (its segment is the last)
    assert rp.ended() == {(7, 0, 0)}   # adopted to its end: built beside the replay


def test_a_close_chunk_naming_another_offset_or_segment_or_none_adopts_no_last_segment():
    seg = rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50, 30], 200)
    for marker in ([], close_row(2, 0, 3, 50, 0), close_row(2, 0, 4, 80, 0), close_row(2, 1, 3, 80, 0)):
        rp = plan(seg + marker, {1: [1, 2]})
        assert [(a.segment, a.closed) for a in rp.adopted] == [(2, False)]
        assert rp.replay_from == {(7, 0, 0): 3} and rp.ended() == set()   # adopted before the replay
        # a close chunk whose segment is replayed keeps its vseg replayed: the new owner learns it
        assert rp.skip == ({1: {2}} if not marker else {})


def test_a_close_chunk_of_a_group_not_adopted_keeps_its_vseg_replayed():
    # streamlet (7, 1) is replayed whole; its close chunk shares vseg 2 with adopted chunks only
    other = [r[:5] + (1,) + r[6:] for r in close_row(2, 0, 0, 100, 40)]
    rows = rows_of(1, 0, 2, [100, 100]) + rows_of(2, 0, 3, [40]) + rows_of(3, 0, 4, [10]) + other
    rp = plan(rows, {1: [1, 2, 3]}, replayed=frozenset({(7, 1)}))
    assert [a.segment for a in rp.adopted] == [2, 3]
    assert rp.skip == {1: {1}}
    rp = plan(rows[:-1], {1: [1, 2, 3]}, replayed=frozenset({(7, 1)}))
    assert rp.skip == {1: {1, 2}}


def test_a_close_chunk_of_an_adopted_segment_keeps_no_vseg_replayed_and_is_never_adopted():
    # the marker shares vseg 2 with segment 3's last chunk; everything else there is taken
    rows = (rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + rows_of(2, 0, 3, [30], 0)
            + close_row(2, 0, 3, 80, 30))
    rows[-2] = rows[-2][:8] + (50,) + rows[-2][9:]   # segment 3's second chunk at offset 50
    rp = plan(rows, {1: [1, 2]})
    assert [(a.segment, a.closed, len(a.rows)) for a in rp.adopted] == [(2, False, 2), (3, True, 2)]
    assert rp.skip == {1: {1, 2}}
    assert not any(r[11] & chunk.CLOSE for a in rp.adopted for r in a.rows.tolist())


def test_the_dead_brokers_closed_index_chunk_is_repointed_as_it_stands():
    rp = plan(rows_of(0, 2, 5, [300], flags=chunk.INDEX | chunk.CLOSE), {1: [0]})
    assert [(a.segment, a.indexed, a.closed) for a in rp.adopted] == [(5, True, False)]
    assert rp.replay_from == {(7, 0, 2): 6} and rp.skip == {1: {0}}
    assert rp.ended() == {(7, 0, 2)}   # its index chunk closes the group
    # an index chunk not flagged CLOSE: the group goes on in the replay
    assert plan(rows_of(0, 2, 5, [300], flags=chunk.INDEX), {1: [0]}).ended() == set()


def test_a_closed_last_segment_with_a_gap_or_in_a_replayed_streamlet_is_not_adopted():
    gap = rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + [(1, 2, 0, 30, 7, 0, 0, 3, 60, 3, 9, 0, 0, 1, 3, 1)]
    rp = plan(gap + close_row(2, 0, 3, 90, 30), {1: [1, 2]})
    assert [a.segment for a in rp.adopted] == [2] and rp.skip == {}
    rows = rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + close_row(1, 0, 3, 50, 250)
    rp = plan(rows, {1: [1]}, replayed=frozenset({(7, 0)}))
    assert rp.adopted == [] and rp.replay_from == {} and rp.skip == {}


def test_a_group_begun_in_released_vsegs_drops_its_first_listed_segment_only():
    # group 0 began below the floor: its first listed segment (3) starts at offset 50 and is
    # dropped, 4 and 5 follow whole, 6 is open; group 1's only listed segment starts past 0
    rows = ([r[:8] + (50,) + r[9:] for r in rows_of(1, 0, 3, [50])] + rows_of(1, 0, 4, [100, 100])
            + rows_of(2, 0, 5, [60]) + rows_of(2, 0, 6, [30])
            + [r[:6] + (1,) + r[7:8] + (70,) + r[9:] for r in rows_of(2, 1, 2, [40], 90)])
    rp = plan(rows, {1: [1, 2]})
    assert [(a.group, a.segment) for a in rp.adopted] == [(0, 4), (0, 5)]
    assert rp.replay_from == {(7, 0, 0): 6} and rp.ended() == set()
    assert rp.skip == {1: {1}}   # vseg 1: the dropped segment 3 went with the adopted ones
    # a gap after the dropped segment: nothing adopted, and it keeps its vseg replayed
    rp = plan(rows[:1] + rows_of(1, 0, 5, [100], 50), {1: [1]})
    assert rp.adopted == [] and rp.replay_from == {} and rp.skip == {}


def test_an_index_chunk_of_a_run_covers_its_segments_and_the_longest_run_is_taken():
    # the dead broker adopted segments 0..2 in one index chunk, and 0..4 in another (a retry)
    run = [r[:14] + (2, 1) for r in rows_of(0, 0, 0, [300], flags=chunk.INDEX)]
    longer = [r[:2] + (300,) + r[3:14] + (4, 1) for r in rows_of(0, 0, 0, [300], flags=chunk.INDEX)]
    rows = run + longer + rows_of(1, 0, 5, [100, 100]) + rows_of(1, 0, 6, [50], 200) + rows_of(2, 0, 7, [80])
    rp = plan(rows, {1: [0, 1, 2]})
    assert [(a.segment, a.indexed) for a in rp.adopted] == [(0, True), (5, False), (6, False)]
    assert rp.adopted[0].rows[0, 2] == 300          # the index chunk of the longer run
    assert rp.replay_from == {(7, 0, 0): 7} and rp.skip == {1: {0, 1}}
    rp = plan(run + rows_of(1, 0, 5, [100]) + rows_of(2, 0, 6, [80]), {1: [0, 1, 2]})
    assert [a.segment for a in rp.adopted] == [0] and rp.replay_from == {(7, 0, 0): 3}  # 3, 4 missing


def test_an_index_chunk_of_a_run_round_trip_and_the_one_segment_format_still_parses():
    rows = np.array([[100, 3, 0, 7, 1], [250, 4, 0, 9, 5], [60, 4, 300, 7, 6]], "<u8")
    ix = index_chunk.SegmentIndex(5, 1, 2, 3, 8, 1, rows, {3: [1, 2], 4: [2]}, [2, 1])
    back = index_chunk.parse(index_chunk.build(ix, closed=True))
    assert (back.segment, back.counts, back.heads, back.starts) == (3, [2, 1], [250, 60], [0, 2])
    assert (back.rows[:, :5] == rows).all() and back.producers() == {7: 6, 9: 5}
    for counts in ([1, 1], [3, 0], [1, 1, 1, 1]):   # counts that do not add up to the rows
        bad = index_chunk.SegmentIndex(5, 1, 2, 3, 8, 1, rows, {3: [1, 2], 4: [2]}, counts)
        with pytest.raises(InvalidArgument):
            index_chunk.build(bad)
    with pytest.raises(ProtocolError):   # a segment's ends must rise
        index_chunk.parse(index_chunk.build(index_chunk.SegmentIndex(
            5, 1, 2, 3, 8, 1, rows, {3: [1, 2], 4: [2]}, [3])))
    # KINDX1: one segment, no counts (what vlogs written before runs hold)
    value = np.concatenate((np.array([index_chunk.MAGIC, 8, 1, 2, 2, 3, *rows[:2].ravel(), 3, 2, 4, 1, 1, 2, 2],
                                     "<u8"),)).tobytes()
    data = bytearray(chunk.build(5, 1, 7, 0, [value], timestamps=0, flags=chunk.INDEX))
    chunk.place(data, 0, 2, 3, 0)
    old = index_chunk.parse(bytes(data))
    assert (old.segment, old.counts, old.heads, old.copies) == (3, [2], [250], {3: [1, 2], 4: [2]})


def test_consecutive_repointed_segments_of_a_group_go_as_one_index_chunk():
    from kera.recovery.repoint import _index_chunk, _runs
    rows = (rows_of(1, 0, 2, [100, 100]) + rows_of(1, 0, 3, [50], 200) + rows_of(2, 0, 4, [80])
            + rows_of(2, 0, 5, [10]) + [r[:6] + (1,) + r[7:] for r in rows_of(2, 1, 0, [30, 30], 90)]
            + [r[:6] + (1,) + r[7:] for r in rows_of(2, 1, 1, [20], 150)])
    rp = plan(rows, {1: [1, 2]})
    runs = list(_runs(rp.adopted))
    assert [[(a.group, a.segment) for a in run] for run in runs] == [[(0, 2), (0, 3), (0, 4)], [(1, 0)]]
    ix = index_chunk.parse(_index_chunk(9, runs[0], {1: {1: [4, 5], 2: [5, 6]}}))
    assert (ix.group, ix.segment, ix.counts, ix.heads, ix.source) == (0, 2, [2, 1, 1], [200, 50, 80], 9)
    assert ix.copies == {1: [4, 5], 2: [5, 6]} and ix.rows[:, 1].tolist() == [1, 1, 1, 2]


def test_the_groups_adopted_after_the_hand_over_carry_each_producers_highest_sequence():
    """``repoint._deferred``: per streamlet the closed groups adopted whole, the highest
    sequence of each producer over all of them (one pass over their rows), a producer of each."""
    from kera.recovery.repoint import _deferred

    def mine(rows, streamlet, producers):   # rows_of's rows of another streamlet and producers
        return [(*r[:5], streamlet, *r[6:9], p, *r[10:]) for r, p in zip(rows, producers, strict=True)]

    rows = (mine(rows_of(0, 0, 0, [100, 100]), 0, [3, 4]) + mine(close_row(0, 0, 0, 200, 200), 0, [3])
            + mine(rows_of(0, 1, 0, [50, 50, 50], 320), 0, [4, 4, 3]) + mine(close_row(0, 1, 0, 150, 470), 0, [4])
            + mine(rows_of(1, 0, 0, [70]), 1, [4]) + mine(close_row(1, 0, 0, 70, 70), 1, [4])
            + mine(rows_of(1, 2, 0, [60]), 0, [9]))   # group 2 still open: not adopted whole
    rp = plan(rows, {1: [0, 1]})
    ended = [i for i in range(len(rp.spans)) if rp.ends(i)]
    assert sorted(rp.spans[i][:3] for i in ended) == [(7, 0, 0), (7, 0, 1), (7, 1, 0)]
    # sequences: segment * 10 + chunk (rows_of): group 0 gives producer 3 0, 4 1; group 1: 4 1, 3 2
    assert _deferred(rp, ended, {}) == {(7, 0): ({0, 1}, {3: 2, 4: 1}, {0: 3, 1: 4}, [0]),
                                        (7, 1): ({0}, {4: 0}, {0: 4}, [0])}
    # with Kafka offsets (base + 1, records): each streamlet's end, where its appends go on
    kafka = [r[:12] + ((10 * i + 1, 10) if r[11] == 0 else (0, 1)) + r[14:] for i, r in enumerate(rows)]
    rp = plan(kafka, {1: [0, 1]})
    got = _deferred(rp, ended, {})
    assert (got[(7, 0)][3], got[(7, 1)][3]) == ([60], [80])
