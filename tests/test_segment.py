"""A segment's buffer is sized to what it holds: it grows as chunks arrive, the budget charges
exactly what the buffers take, and slices already out stay valid across a growth."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kera import chunk
from kera.broker import retention
from kera.broker.memory import MemoryBudget
from kera.broker.segment import MIN_BUFFER, MMAP_BUFFER, buffer_size
from kera.broker.streamlet import Streamlet
from kera.errors import BrokerFull, DataLoss
from kera.vlog import VirtualLog

from .conftest import stream_meta
from .test_vlog_core import ack_all, backups

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def chunks(n: int, size: int = 100, seq: int = 0) -> list[bytes]:
    return [chunk.build(1, 0, 7, seq + i, [bytes([i % 251]) * size]) for i in range(n)]


def held(sl: Streamlet) -> int:
    """What the segments' buffers take, summed: the budget must be charged exactly that."""
    return sum(seg.held for g in sl.groups.values() for seg in g.segments)


def replicated(sl: Streamlet, seg, vlog_id: int = 1):
    """Reference ``seg``'s chunks in a vlog of one copy, acknowledged and closed: settled."""
    r = SimpleNamespace(log=VirtualLog(vlog_id, 1, 1 << 20, backups({1: "n1"})))
    start = 0
    for end in seg.ends:
        r.log.append(seg, start, end - start, 0)
        seg.noted(r, r.log.open, r.log.open.size - (end - start))
        start = end
    ack_all(r.log, r.log.poll(0.0))
    r.log.close_open()
    ack_all(r.log, r.log.poll(0.0))
    assert seg.replicated()
    return r


def test_one_small_record_takes_a_small_buffer_not_a_segment():
    memory = MemoryBudget(1 * MiB)
    sl = Streamlet(stream_meta(), 0, memory)   # 1 MiB segments
    (c,) = chunks(1)
    g, seg, off = sl.append(c, 7)
    assert seg.capacity == MiB and seg.held == buffer_size(len(c), MiB) == MIN_BUFFER
    assert memory.used == seg.held and bytes(seg.view[:seg.head]) == c


def test_a_grown_buffer_is_a_new_one_and_views_of_the_old_stay_valid():
    """A pull's reply and a replicate in flight hold slices of the buffer: a growth moves
    the bytes to a new buffer (the old one is never resized, which a bytearray with views
    out refuses), the slices keep reading the old one, and the bytes agree."""
    memory = MemoryBudget(4 * MiB)
    sl = Streamlet(stream_meta(), 0, memory)
    r = SimpleNamespace(log=VirtualLog(1, 1, 8 * MiB, backups({1: "n1"})))
    first = chunks(1)[0]
    g, seg, off = sl.append(first, 7)
    r.log.append(seg, off, len(first), 0)
    pulled = seg.part(0, len(first))               # a pull's slice
    (sending,) = r.log.open.parts(0, 1)            # a replicate's slice
    old = seg.buf
    sizes = [seg.held]
    expect = bytearray(first)
    for c in chunks(5000, 180, seq=1):             # ~1 MiB: through every size, bytearrays then mmaps
        if seg.room() < len(c):
            break
        g, s2, off = sl.append(c, 7)
        assert s2 is seg and off == len(expect)
        expect += c
        if seg.held != sizes[-1]:
            sizes.append(seg.held)
        assert memory.used == held(sl) == seg.held >= seg.head
    assert sizes == [1 << k for k in range(MIN_BUFFER.bit_length() - 1, 21)]   # 256 B .. 1 MiB
    assert seg.buf is not old and isinstance(old, bytearray) and isinstance(seg.buf, mmap.mmap)
    assert len(seg.buf) == seg.capacity and MMAP_BUFFER <= seg.capacity
    assert bytes(pulled) == bytes(sending) == first and pulled.obj is old   # still the old buffer
    assert bytes(seg.view[:seg.head]) == expect
    assert bytes(r.log.open.parts(0, 1)[0]) == first   # a resend now slices the new buffer
    # the next segment of the group starts at what this one held: no growth again
    c = chunks(1, 3000, seq=9000)[0]
    g, nxt, off = sl.append(c, 7)
    assert nxt is not seg and off == 0 and nxt.held == MiB and memory.used == held(sl)
    # a new group starts small again
    g2 = sl._new_group(0)
    g2.append(c)
    assert g2.segments[0].held == 4096 and memory.used == held(sl)


def test_a_growth_the_budget_refuses_changes_nothing():
    memory = MemoryBudget(1024)
    sl = Streamlet(stream_meta(), 0, memory)
    cs = chunks(6, 200)   # ~316 B each: 256 -> 512 -> 1024, then 2048 is refused
    for c in cs[:3]:
        g, seg, _ = sl.append(c, 7)
    assert seg.held == 1024 == memory.used
    view, head = seg.view, seg.head
    with pytest.raises(BrokerFull):
        sl.append(cs[3], 7)
    assert (seg.view, seg.head, seg.held, memory.used, sl.appended_chunks) == (view, head, 1024, 1024, 3)
    assert not seg.filled_at and len(seg.ends) == 3   # still takes chunks once memory is back
    memory.limit = 4096
    g, s2, off = sl.append(cs[3], 7)
    assert s2 is seg and off == head and seg.held == 2048 == memory.used


def test_a_partly_filled_segment_is_evicted_for_what_its_buffer_takes():
    """A segment filled at 3 KB of its 64 KiB (the next chunk did not fit) holds a 4 KiB
    buffer: eviction credits those 4 KiB, and its index (chunk ends, vseg, offset there)
    is what a tiered read needs."""
    memory = MemoryBudget(256 << 10)
    sl = Streamlet(stream_meta(segment_size=64 << 10, group_segments=4), 0, memory)
    small, large = chunks(1, 3000)[0], chunks(1, 63 << 10, seq=1)[0]
    g, seg, _ = sl.append(small, 7)
    g, nxt, _ = sl.append(large, 7)                 # does not fit: seg is filled at 3 KB
    assert nxt is not seg and seg.filled_at and seg in memory.resident
    assert (seg.head, seg.held, nxt.held) == (len(small), 4096, 64 << 10)
    assert memory.used == held(sl) == 4096 + (64 << 10)
    replicated(sl, seg)
    assert memory.evict(1) == 4096
    assert seg.evicted and seg.view is None and seg.held == 0
    assert memory.used == held(sl) == 64 << 10
    assert (seg.ends, list(seg.vplaces)) == ([len(small)], [0, 0])
    assert seg.part(0, seg.head) is None            # read back from a backup (kera.broker.tiered)
    retention.expired(sl, 0.0)                                 # no retention here: nothing freed
    memory.free(nxt)                                # the stream leaves: the rest is credited
    assert memory.used == 0


def test_recovery_replays_into_a_growing_buffer_at_the_recorded_places():
    """A replay places each chunk where its header says; the buffer grows as on appends,
    copies replayed again are skipped, a hole is refused, and appends go on after it."""
    memory = MemoryBudget(1 * MiB)
    sl = Streamlet(stream_meta(segment_size=64 << 10, group_segments=2), 0, memory)
    sl.recovering = True
    cs = chunks(50, 1500)
    where, at = [], 0
    for c in cs:                                    # where the dead broker had put them
        if at + len(c) > 64 << 10:
            break
        where.append(at)
        at += len(c)
    for c, off in zip(cs[:len(where)], where, strict=True):
        g, seg = sl.place(c, 7, 0, 0, off)
        assert seg is not None and seg.head == off + len(c) and memory.used == held(sl)
    assert seg.held == 64 << 10 and bytes(seg.view[:seg.head]) == b"".join(cs[:len(where)])
    assert sl.place(cs[3], 7, 0, 0, where[3])[1] is None        # replayed again: skipped
    with pytest.raises(DataLoss):
        sl.place(cs[0], 7, 0, 1, 100)                           # the start of segment 1 lost
    g, seg1 = sl.place(cs[len(where)], 7, 0, 1, 0)              # sized as segment 0 was
    assert seg1.held == 64 << 10 and memory.used == held(sl)
    sl.finish_recovery()
    c = chunks(1, 1500, seq=100)[0]
    g, s, off = sl.append(c, 7)
    assert s is seg1 and off == len(cs[len(where)]) and memory.used == held(sl)


@settings(max_examples=60, deadline=None)
@given(st.integers(1 << 10, 1 << 16), st.sampled_from([0, 2048, 16384, 1 << 20]),
       st.lists(st.integers(0, 20000), min_size=1, max_size=60))
def test_buffers_hold_their_chunks_and_the_budget_counts_them_exactly(capacity, limit, values):
    """Any chunks, any budget: each segment's bytes are its chunks back to back, a buffer
    takes at most twice what it holds (or ``MIN_BUFFER``, or what the segment before it in
    its group held), the budget is charged exactly what the buffers take, and a refused
    chunk changes nothing."""
    memory = MemoryBudget(limit)
    sl = Streamlet(stream_meta(segment_size=capacity, group_segments=3), 0, memory)
    kept: dict = {}
    for i, size in enumerate(values):
        c = chunk.build(1, 0, 7, i, [b"v" * size])
        if len(c) > capacity:
            continue
        before = (memory.used, sl.appended_chunks)
        try:
            g, seg, off = sl.append(c, 7)
        except BrokerFull:
            assert (memory.used, sl.appended_chunks) == before
            continue
        kept.setdefault(seg, []).append(c)
        assert memory.used == held(sl)
        for s, cs in kept.items():
            assert bytes(s.view[:s.head]) == b"".join(cs)
            g = next(g for g in sl.groups.values() if s in g.segments)
            before = g.segments[s.id - 1].head if s.id else 0
            assert s.head <= s.held <= s.capacity
            assert s.held <= max(MIN_BUFFER, 2 * s.head - 1, buffer_size(before, capacity))


def test_a_streamlets_first_record_costs_a_broker_little_memory():
    """What a streamlet's first chunk adds on a broker, in Python objects (tracemalloc, the
    mean over 5,000 streamlets): its group and the map of its groups (which an idle
    streamlet does not have), segment, 256-byte buffer, per-chunk arrays and where its vlog
    put the chunk, Kafka offset row and producer state; no long-lived view of the buffer (a
    memoryview and its managed buffer were 312 of the 2,425 bytes it cost before), its tail
    in its vlog as a list of two, not a dict of one (152 bytes less), its one producer's
    state alone, not in a dict of one (216 bytes less), and its chunks' virtual segment ids
    and offsets in one array, not two (120 bytes less: 1,896 -> 1,776)."""
    import gc
    import tracemalloc

    n = 5000
    sls = [Streamlet(stream_meta(name=f"m{i}", id=i), 0) for i in range(n)]
    vsegs = [SimpleNamespace(id=i, live=0) for i in range(n)]
    c = chunks(1)[0]
    was = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for sl, vs in zip(sls, vsegs, strict=True):
            g, seg, off = sl.append(c, 7)
            seg.noted(1 << 40, vs, 1 << 33)
            sl.note_producer(7, 0, 1 << 40, 1 << 33, seg, off + len(c))
        per = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
        if was:
            gc.enable()
    assert per <= 1850, f"{per:.0f} bytes per streamlet's first record"
