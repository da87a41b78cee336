"""Recovery placement on the new owner: replayed copies are skipped, holes are refused."""

from __future__ import annotations

import pytest

from kera.broker.memory import MemoryBudget
from kera.broker.streamlet import Streamlet
from kera.errors import BrokerFull, DataLoss, KeraError, from_wire

from .conftest import stream_meta

pytestmark = pytest.mark.timeout(30)

STREAM = stream_meta(id=5, streamlets=2, groups=2, segment_size=4096, group_segments=4)


def test_place_in_order_then_duplicates_skipped():
    sl = Streamlet(STREAM, 1)
    a, b = b"a" * 100, b"b" * 50
    g, seg = sl.place(a, 7, 0, 0, 0)
    assert seg is not None and seg.head == 100
    g, seg = sl.place(b, 7, 0, 0, 100)
    assert seg.head == 150
    assert sl.place(a, 7, 0, 0, 0)[1] is None  # a copy already placed (replay after a failure)
    g, seg = sl.place(a, 7, 0, 1, 0)  # the next segment of the group
    assert seg.id == 1 and len(g.segments) == 2


def test_hole_in_a_segment_is_refused_and_nothing_stored():
    sl = Streamlet(STREAM, 1)
    sl.place(b"a" * 100, 7, 0, 0, 0)
    with pytest.raises(DataLoss) as ei:
        sl.place(b"c" * 10, 7, 0, 0, 300)
    e = ei.value
    assert (e.stream_id, e.streamlet, e.group, e.segment, e.offset) == (5, 1, 0, 0, 300)
    assert "stream 5 streamlet 1" in str(e) and "hole" in str(e)
    assert sl.groups[0].segments[0].head == 100 and sl.appended_chunks == 1
    # the error crosses the wire as itself, with where it happened
    again = from_wire(e.to_wire())
    assert isinstance(again, DataLoss) and again.offset == 300 and isinstance(again, KeraError)


def test_skipped_segment_is_a_hole():
    sl = Streamlet(STREAM, 0)
    sl.place(b"a" * 100, 7, 0, 0, 0)
    with pytest.raises(DataLoss):
        sl.place(b"a" * 100, 7, 0, 2, 0)  # segment 1 never seen: its chunks were lost
    assert len(sl.groups[0].segments) == 1  # nothing allocated for the hole
    with pytest.raises(DataLoss):
        sl.place(b"a" * 100, 7, 1, 0, 100)  # a new group starting mid-segment
    assert list(sl.groups) == [0] and sl.next_group == 1


def test_sealed_after_a_loss_no_group_id_or_position_is_reused():
    sl = Streamlet(STREAM, 1)
    sl.recovering = True
    sl.place(b"a" * 100, 7, 0, 0, 0)
    sl.place(b"b" * 100, 8, 3, 0, 0)   # group 3 replayed; groups past it may have been lost
    sl.finish_recovery()
    sl.seal()
    assert all(g.closed for g in sl.groups.values())
    g, seg, off = sl.append(b"c" * 100, 7)
    assert g.id >= 4 + (1 << 16) and (seg.id, off) == (0, 0)
    assert len(sl.groups[0].segments[0].ends) == 1   # nothing appended to a recovered group


def test_a_hole_in_a_group_left_empty_by_a_full_broker_is_still_data_loss():
    """A group whose first segment the memory budget refused exists without segments:
    a later chunk past a hole in it is refused as a loss, and the group stays."""
    sl = Streamlet(STREAM, 1, MemoryBudget(100))
    with pytest.raises(BrokerFull):
        sl.place(b"a" * 100, 7, 0, 0, 0)
    assert sl.groups[0].segments == []
    with pytest.raises(DataLoss):
        sl.place(b"c" * 10, 7, 0, 0, 300)
    assert 0 in sl.groups and sl.next_group == 1


def test_a_segment_noted_filled_takes_no_more_chunks_after_the_budget_refused_the_next():
    """Found by the simulator (``python -m kera.sim --seed 776`` before the fix): a chunk
    that did not fit noted its segment filled (so the budget may evict it), the budget
    refused the next segment, and a smaller chunk then landed in the filled segment, into
    its dropped buffer once evicted."""
    sl = Streamlet(STREAM, 1, MemoryBudget(4096))
    g, seg, _ = sl.append(b"a" * 3000, 7)
    with pytest.raises(BrokerFull):
        sl.append(b"b" * 2000, 7)
    assert seg.filled_at and seg in sl.memory.resident
    with pytest.raises(BrokerFull):
        sl.append(b"c" * 500, 7)
    assert seg.head == 3000 and len(g.segments) == 1
