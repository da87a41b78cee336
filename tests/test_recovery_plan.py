"""The recovery plan alone (pure code): which copy each chunk is replayed from, where a log ends."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kera.errors import ProtocolError
from kera.recovery.plan import (
    CORRUPT,
    END,
    FAILED,
    REFUSED,
    Done,
    Listing,
    PlanError,
    RecoveryPlan,
    Step,
    Truncated,
    backup_copies,
)
from kera.recovery.repoint import _asked

pytestmark = pytest.mark.timeout(60)

BROKER, EPOCH = 3, 7
VLOG = EPOCH << 32 | 0
VLOG2 = EPOCH << 32 | 1


def seg(vseg, length, vlog=VLOG, corrupt=(), closed=False, broker=BROKER):
    """One entry of a backup's ``list`` answer (``Replica.info()``)."""
    return {"broker": broker, "vlog": vlog, "vseg": vseg, "length": length, "chunks": length // 100,
            "closed": closed, "checksum": 0, "epoch": EPOCH,
            "corrupt": [{"offset": o, "length": n, "reason": "test"} for o, n in corrupt]}


def plan_of(listings):
    return RecoveryPlan(BROKER, EPOCH, listings)


def as_columns(listings: dict) -> dict:
    """The listings as a recovery asks for them (backup ``list`` with ``columns``): the closed,
    intact copies as rows, the others as maps."""
    def plain(s):
        return s["closed"] and not s["corrupt"] and "error" not in s
    return {b: Listing([s for s in segs if not plain(s)],
                       np.array([[s["vlog"], s["vseg"], s["length"], s["chunks"], s["checksum"]]
                                 for s in segs if plain(s)], "<u8").reshape(-1, 5))
            for b, segs in listings.items()}


def test_a_listing_as_columns_plans_as_its_maps():
    listings = {1: [seg(0, 1000, closed=True), seg(1, 700, corrupt=[(100, 50)], closed=True), seg(2, 300),
                    seg(0, 100, vlog=(EPOCH + 1) << 32, closed=True), seg(0, 500, vlog=VLOG2, closed=True)],
                2: [seg(0, 1000, closed=True), seg(1, 800, closed=True), seg(2, 350, closed=True)]}
    maps, cols = RecoveryPlan(BROKER, EPOCH, listings, floors={VLOG2: 1}), \
        RecoveryPlan(BROKER, EPOCH, as_columns(listings), floors={VLOG2: 1})
    assert as_columns(listings)[1].plain[:, 1].tolist() == [0, 0, 0]   # three rows of backup 1
    assert maps.vlogs == cols.vlogs == [VLOG, VLOG2]   # another epoch's left out; VLOG2's below its floor
    assert {v: maps._vlogs[v].vsegs for v in maps.vlogs} == {v: cols._vlogs[v].vsegs for v in cols.vlogs}
    assert maps.total_bytes == cols.total_bytes and maps.settled(VLOG) == cols.settled(VLOG) == [(0, [1, 2])]
    with pytest.raises(ProtocolError, match="rows of columns"):
        Listing.of({"segments": [], "plain": 2}, b"\0" * 40)
    old = Listing.of({"segments": [seg(0, 100)]}, b"")   # a backup that lists maps only
    assert old.segments == [seg(0, 100)] and old.plain.shape == (0, 5)


def test_one_copy_corrupt_continues_from_another():
    plan = plan_of({1: [seg(0, 1000), seg(0, 500, vlog=VLOG2)], 2: [seg(0, 1000, corrupt=[(400, 100)])]})
    first = plan.next_step(VLOG2)  # keeps backup 1 busy: the next step goes to backup 2
    assert first.backup == 1
    s = plan.next_step(VLOG)
    assert (s.backup, s.offset, s.until) == (2, 0, 400)  # intact up to its corrupt chunk
    plan.step_done(VLOG, 0, 2, 400, CORRUPT, 500)
    s = plan.next_step(VLOG)
    assert (s.backup, s.offset) == (1, 400)  # the same offset, from the other copy
    plan.step_done(VLOG, 0, 1, 1000, END)
    assert plan.next_step(VLOG) == Done(VLOG, 0, 1000)
    plan.step_done(VLOG2, 0, 1, 500, END)
    assert isinstance(plan.next_step(VLOG2), Done)
    assert plan.complete and plan.lost == []


def test_corrupt_found_on_read_switches_copy_and_back():
    """A copy corrupt at 300 (found only when read) hands over to the other, which is corrupt at 600."""
    plan = plan_of({1: [seg(0, 1000)], 2: [seg(0, 1000, corrupt=[(600, 100)])]})
    s = plan.next_step(VLOG)
    assert s.backup == 1 and s.until == 1000  # the longest intact run first when no one is busy
    plan.step_done(VLOG, 0, 1, 300, CORRUPT, 400)
    s = plan.next_step(VLOG)
    assert (s.backup, s.offset, s.until) == (2, 300, 600)
    plan.step_done(VLOG, 0, 2, 600, CORRUPT, 700)
    s = plan.next_step(VLOG)
    assert (s.backup, s.offset) == (1, 600)  # intact again past its own corrupt chunk
    plan.step_done(VLOG, 0, 1, 1000, END)
    assert isinstance(plan.next_step(VLOG), Done)
    assert plan.counts() == {"steps": 3, "corrupt_steps": 2, "failed_steps": 0}


def test_all_copies_corrupt_at_the_same_chunk_truncates_with_exact_range():
    plan = plan_of({1: [seg(0, 1000, corrupt=[(500, 100)]), seg(1, 800)],
                    2: [seg(0, 900, corrupt=[(500, 100)]), seg(1, 800)]})
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 500, CORRUPT, 600)
    t = plan.next_step(VLOG)
    assert isinstance(t, Truncated) and (t.vseg, t.offset, t.reason) == (0, 500, "no intact copy")
    assert [(r.vseg, r.offset, r.end) for r in t.lost] == [(0, 500, 1000), (1, 0, 800)]
    assert not plan.complete and plan.finished and not t.failed
    assert plan.lost[0].describe()["vlog"] == VLOG
    assert plan.next_step(VLOG) is t  # an ended vlog stays ended


def test_missing_vseg_id_truncates():
    plan = plan_of({1: [seg(0, 500, closed=True), seg(2, 300)], 2: [seg(0, 500), seg(3, 200)]})
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 500, END)
    t = plan.next_step(VLOG)
    assert isinstance(t, Truncated) and (t.vseg, t.offset, t.reason) == (1, 0, "missing")
    assert [(r.vseg, r.offset, r.end) for r in t.lost] == [(1, 0, None), (2, 0, 300), (3, 0, 200)]


def test_an_open_vseg_followed_by_others_ends_the_log():
    """Nothing after a vseg whose close no copy took was acknowledged: the log ends there."""
    plan = plan_of({1: [seg(0, 500), seg(1, 300)], 2: [seg(0, 400)]})
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 500, END)
    assert plan.next_step(VLOG) == Done(VLOG, 0, 500, False)
    assert plan.complete and plan.lost == []


def test_expected_vlog_without_any_copy_is_lost_not_absent():
    plan = RecoveryPlan(BROKER, EPOCH, {1: [seg(0, 100)]}, expected=[VLOG, VLOG2, (EPOCH + 1) << 32])
    assert plan.vlogs == [VLOG, VLOG2]
    t = plan.next_step(VLOG2)
    assert isinstance(t, Truncated) and t.reason == "missing"
    assert [(r.vseg, r.offset, r.end) for r in t.lost] == [(0, 0, None)]


def test_missing_first_vseg_truncates_at_once():
    plan = plan_of({1: [seg(1, 500)]})
    t = plan.next_step(VLOG)
    assert isinstance(t, Truncated) and (t.vseg, t.offset) == (0, 0)


def test_copy_lengths_differ_the_short_one_hands_over_at_its_end():
    plan = plan_of({1: [seg(0, 400)], 2: [seg(0, 1000)], 3: [seg(0, 700)]})
    # three vlogs' worth of load is not here: the longest run wins when nobody is busy
    s = plan.next_step(VLOG)
    assert (s.backup, s.until) == (2, 1000)
    plan.step_done(VLOG, 0, 2, 1000, END)
    assert plan.next_step(VLOG) == Done(VLOG, 0, 1000)


def test_short_copy_used_then_longer_one_continues():
    """Load spreading may pick the short copy first: the rest comes from a longer one."""
    plan = plan_of({1: [seg(0, 400), seg(0, 400, vlog=VLOG2)], 2: [seg(0, 1000), seg(0, 1000, vlog=VLOG2)]})
    a = plan.next_step(VLOG)
    b = plan.next_step(VLOG2)
    assert {a.backup, b.backup} == {1, 2}  # both backups work at once
    short = a if a.backup == 1 else b
    assert short.until == 400
    plan.step_done(short.vlog, 0, 1, 400, END)
    s = plan.next_step(short.vlog)
    assert (s.backup, s.offset) == (2, 400)


def test_backup_failure_mid_step_retries_from_another_copy():
    plan = plan_of({1: [seg(0, 1000)], 2: [seg(0, 1000)]})
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 0, FAILED)  # progress unknown: from the step's start
    s2 = plan.next_step(VLOG)
    assert s2.backup != s.backup and s2.offset == 0
    plan.step_done(VLOG, 0, s2.backup, 1000, END)
    assert isinstance(plan.next_step(VLOG), Done)
    assert plan.complete and plan.counts()["failed_steps"] == 1


def test_truncation_names_failed_copies_that_might_hold_the_rest():
    plan = plan_of({1: [seg(0, 1000)], 2: [seg(0, 1000, corrupt=[(200, 100)])]})
    s = plan.next_step(VLOG)
    assert s.backup == 1
    plan.step_done(VLOG, 0, 1, 200, FAILED)
    t = plan.next_step(VLOG)
    assert isinstance(t, Truncated) and t.offset == 200 and t.failed == {1}


def test_longest_copy_corrupt_early_is_not_chosen():
    plan = plan_of({1: [seg(0, 5000, corrupt=[(0, 100)])], 2: [seg(0, 3000)]})
    s = plan.next_step(VLOG)
    assert s.backup == 2 and s.offset == 0
    plan.step_done(VLOG, 0, 2, 3000, END)
    s = plan.next_step(VLOG)
    assert (s.backup, s.offset, s.until) == (1, 3000, 5000)


def test_offset_inside_a_corrupt_region_is_not_served_by_that_copy():
    """A damaged chunk header hides the chunk boundaries up to the region's end."""
    plan = plan_of({1: [seg(0, 1000, corrupt=[(100, 900)])], 2: [seg(0, 1000)]})
    s = plan.next_step(VLOG)
    assert (s.backup, s.until) == (2, 1000)
    plan.step_done(VLOG, 0, 2, 400, CORRUPT, 500)  # found when read back
    t = plan.next_step(VLOG)  # 400 lies inside copy 1's damaged region: nobody has it
    assert isinstance(t, Truncated) and t.offset == 400
    assert [(r.offset, r.end) for r in t.lost] == [(400, 1000)]


def test_refused_chunk_ends_the_log():
    plan = plan_of({1: [seg(0, 1000)]})
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 300, REFUSED)
    t = plan.next_step(VLOG)
    assert isinstance(t, Truncated) and (t.offset, t.reason) == (300, "refused")


def test_other_incarnations_ignored_and_protocol_checked():
    plan = plan_of({1: [seg(0, 100), seg(0, 100, broker=BROKER + 1), seg(0, 100, vlog=(EPOCH + 1) << 32)]})
    assert plan.vlogs == [VLOG] and plan.total_bytes == 100
    s = plan.next_step(VLOG)
    with pytest.raises(PlanError):
        plan.next_step(VLOG)  # one step at a time
    with pytest.raises(PlanError):
        plan.step_done(VLOG, 0, 2, 100, END)  # not the backup given the step
    with pytest.raises(PlanError):
        plan.step_done(VLOG, 0, s.backup, 101, END)  # past the copy
    plan.step_done(VLOG, 0, s.backup, 100, END)
    assert plan.next_step(VLOG) == Done(VLOG, 0, 100)


def test_a_closed_copy_bounds_the_vseg_whatever_a_damaged_copy_claims():
    """A damaged copy's corrupt tail (trailer bytes included) is not data the log must have."""
    plan = plan_of({1: [seg(0, 1088, corrupt=[(500, 588)])], 2: [seg(0, 1000, closed=True)]})
    assert plan.vseg_length(VLOG, 0) == 1000
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 1000 if s.backup == 2 else 500, END if s.backup == 2 else CORRUPT)
    if s.backup == 1:
        s = plan.next_step(VLOG)
        plan.step_done(VLOG, 0, 2, 1000, END)
    assert plan.next_step(VLOG) == Done(VLOG, 0, 1000, head_closed=True)
    # a closed copy whose damage has no known end says nothing of the length
    plan = plan_of({1: [seg(0, 0, closed=True, corrupt=[(0, 400)])], 2: [seg(0, 1000)]})
    assert plan.vseg_length(VLOG, 0) == 1000


def test_closed_head_is_reported():
    plan = plan_of({1: [seg(0, 100, closed=True)]})
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 100, END)
    assert plan.next_step(VLOG) == Done(VLOG, 0, 100, head_closed=True)


# -- property: a simulated cluster of copies, driven to the end -------------------------------

CHUNK = 100  # every chunk 100 bytes: offsets are chunk indexes * CHUNK


@st.composite
def scenarios(draw):
    """Per vseg a number of chunks; per copy a prefix length, corrupt chunks (known on load or
    found on read), and maybe a failure after some chunks delivered."""
    nvsegs = draw(st.integers(1, 4))
    present = [v for v in range(nvsegs) if draw(st.integers(0, 9)) > 0]
    sizes = {v: draw(st.integers(0, 8)) for v in present}
    nbackups = draw(st.integers(1, 3))
    copies = {}
    for v in present:
        for b in draw(st.sets(st.integers(1, nbackups), min_size=1)):
            n = draw(st.integers(0, sizes[v]))
            bad = draw(st.sets(st.integers(0, max(0, n - 1)), max_size=2)) if n else set()
            known = {c for c in bad if draw(st.booleans())}
            fail = draw(st.none() | st.integers(0, max(0, n)))
            closed = n == sizes[v] and draw(st.booleans())  # only a complete copy is closed
            copies[(v, b)] = (n, bad, known, fail, closed)
    return present, sizes, copies, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_replays_every_intact_chunk_once_in_order(sc):
    present, sizes, copies, columns = sc
    listings: dict[int, list] = {}
    for (v, b), (n, _bad, known, _fail, closed) in copies.items():
        listings.setdefault(b, []).append(seg(v, n * CHUNK, corrupt=[(c * CHUNK, CHUNK) for c in known],
                                              closed=closed))
    plan = plan_of(as_columns(listings) if columns else listings)
    if not present:
        assert plan.vlogs == [] and plan.complete
        return
    placed: list[tuple[int, int]] = []  # (vseg, chunk index) in placement order, never a hole
    failed_once: set = set()

    def place(v, i):
        if (v, i) in placed:
            return  # a replayed copy: idempotent
        expected = (v, i - 1) if i else None
        if expected is not None:
            assert placed and placed[-1] == expected, f"hole before {(v, i)}"
        placed.append((v, i))

    for _ in range(200):
        s = plan.next_step(VLOG)
        if not isinstance(s, Step):
            break
        n, bad, _known, fail, _closed = copies[(s.vseg, s.backup)]
        i = s.offset // CHUNK
        delivered = 0
        while True:
            if fail is not None and delivered == fail and (s.vseg, s.backup) not in failed_once:
                failed_once.add((s.vseg, s.backup))
                plan.step_done(VLOG, s.vseg, s.backup, s.offset, FAILED)
                break
            if i >= n:
                plan.step_done(VLOG, s.vseg, s.backup, i * CHUNK, END)
                break
            if i in bad:
                plan.step_done(VLOG, s.vseg, s.backup, i * CHUNK, CORRUPT, (i + 1) * CHUNK)
                break
            place(s.vseg, i)
            i += 1
            delivered += 1
    else:
        raise AssertionError("the plan did not end")

    # where the log must end without failures: the first chunk no copy holds intact
    def intact_somewhere(v, i, usable):
        return any(vv == v and i < n and i not in bad and usable(vv, b)
                   for (vv, b), (n, bad, _k, _f, _c) in copies.items())

    out = plan.next_step(VLOG)
    if isinstance(out, Done):
        # the log ends at the newest vseg, or at an open one followed by others (nothing after
        # an unclosed vseg was acknowledged: the durable head waits for closes)
        assert all(v in present for v in range(out.vseg))
        got = set(placed)
        for v in sorted(present):
            if v > out.vseg:
                assert not any(p[0] == v for p in placed)
                continue
            longest = max(n for (vv, _b), (n, *_r) in copies.items() if vv == v)
            assert all((v, i) in got for i in range(longest))
    else:
        assert isinstance(out, Truncated)
        v, i = out.vseg, out.offset // CHUNK
        # nothing after the end was placed (unless a copy that failed got further first)
        if not out.failed:
            assert all(p < (v, i) for p in placed)
        if out.reason == "missing":
            assert v not in present and i == 0
        else:
            assert not intact_somewhere(v, i, lambda vv, b: (vv, b) not in failed_once), \
                f"truncated at {(v, i)} although a working copy holds it intact"
            assert out.failed == {b for (vv, b) in failed_once
                                  if vv == v and copies[(vv, b)][0] > i}
            assert out.lost[0].offset == out.offset


def test_a_vseg_is_settled_only_when_every_copy_listed_is_whole():
    """Found by the simulator (seed 506 of ``python -m kera.sim``, before the fix): R=3, one
    copy closed and whole, the other one chunk short (the broker died before it got the last
    chunk and the close). Settling the vseg named only the whole copy, whose early chunk had
    rotted unseen: the adopted, acknowledged chunk was readable nowhere, while the replay reads
    it from the shorter copy. A vseg with a copy shorter, open or known corrupt is replayed."""
    short = {1: [seg(0, 1000, closed=True), seg(1, 800, closed=True)], 2: [seg(0, 900), seg(1, 800, closed=True)]}
    assert plan_of(short).settled(VLOG) == []
    damaged = {1: [seg(0, 1000, closed=True)], 2: [seg(0, 1000, closed=True, corrupt=[(100, 100)])]}
    assert plan_of(damaged).settled(VLOG) == []
    whole = {1: [seg(0, 1000, closed=True), seg(1, 800)], 2: [seg(0, 1000, closed=True)], 3: []}
    assert plan_of(whole).settled(VLOG) == [(0, [1, 2])]


def test_after_a_hand_over_a_vseg_is_adopted_from_its_whole_copies_alone():
    """The adoption after a hand-over (``kera.adoption``) can no longer replay: a vseg with
    a copy short or found corrupt since is adopted from its whole intact copies (named
    alone); the list still ends at the first vseg with none (a gap is never taken for
    segments freed)."""
    vsegs = {1: [seg(0, 1000, closed=True), seg(1, 800, closed=True), seg(2, 500, closed=True)],
             2: [seg(0, 900), seg(1, 800, closed=True, corrupt=[(100, 100)]), seg(2, 500, closed=True)],
             3: [seg(1, 800, closed=True, corrupt=[(0, 100)])]}
    assert plan_of(vsegs).settled(VLOG) == []
    assert plan_of(vsegs).settled(VLOG, any_whole=True) == [(0, [1]), (1, [1]), (2, [1, 2])]
    nowhere = {1: [seg(0, 1000, closed=True, corrupt=[(0, 10)]), seg(1, 800, closed=True)]}
    assert plan_of(nowhere).settled(VLOG, any_whole=True) == []


def test_a_settled_vseg_whole_on_fewer_backups_than_its_chunks_need_is_indexed_verified():
    """Found by the simulator (seed 125905, before the fix): R=3, a vseg never made durable
    (its other copy's backup crashed) was closed and whole on one backup, where a bit of an
    unacknowledged chunk's body had flipped. The listing and the headers cannot show it: the
    segment was adopted naming that copy alone, a chunk nobody can read. A vseg held whole
    by fewer backups than ``need`` (its chunks' acknowledged copies, R - 1 of the streams')
    is asked verified (bodies read back first), a rotten copy then refuses it and the
    replay, which reads every chunk, takes it from there."""
    assert [backup_copies(rs) for rs in ([3, 3], [1], [2, 3], [], [5])] == [2, 1, 1, 1, 4]
    listings = {1: [seg(0, 1000, closed=True), seg(1, 800, closed=True)], 2: [seg(0, 1000, closed=True)]}
    for need, verified in ((1, [False, False]), (2, [True, False]), (3, [True, True])):
        plan = RecoveryPlan(BROKER, EPOCH, listings, need=need)
        asked = _asked(plan, {VLOG: plan.settled(VLOG)}, False, 0)
        assert [(v, s, bs, verify) for v, s, bs, _, verify in asked] == [
            (VLOG, 1, [1], verified[0]), (VLOG, 0, [1, 2], verified[1])]


def test_the_settled_prefix_follows_its_copies_once_a_step_changed_them():
    """``settled`` is computed once before a vlog's first step; a step that finds a copy
    failing changes it, and the next call says so (no answer kept from before)."""
    plan = plan_of({1: [seg(0, 1000, closed=True)], 2: [seg(0, 1000, closed=True)]})
    assert plan.settled(VLOG) == [(0, [1, 2])]
    assert plan.settled(VLOG) == [(0, [1, 2])]   # the same answer, twice
    s = plan.next_step(VLOG)
    plan.step_done(VLOG, 0, s.backup, 0, FAILED)
    other = 2 if s.backup == 1 else 1
    assert plan.settled(VLOG) == [(0, [other])]   # the failed copy is named no more


def test_a_replays_routes_fit_a_frame_whatever_the_streamlets_recovered():
    """The routes of a replay (a streamlet -> its new owner) go in the request's payload,
    packed: a broker of 333,334 streamlets (a million streams on three nodes) made 8 MB of
    them in the meta, over MAX_META, and its recovery lost every copy as unreadable."""
    import msgpack

    from kera.errors import InvalidArgument
    from kera.limits import MAX_META, MAX_PAYLOAD
    from kera.recovery.routes import ROUTE, pack_routes, parse_routes

    n = 400_000   # streamlets of the broker recovered
    routes = [(sid, 0, f"127.0.0.1:{4000 + sid % 3}", 7 + sid % 3) for sid in range(n)]
    owners, rows = pack_routes(routes)
    assert len(owners) == 3 and len(msgpack.packb({"owners": owners})) < 100
    assert len(rows) == n * ROUTE.itemsize <= MAX_PAYLOAD
    assert len(msgpack.packb([list(r) for r in routes])) > MAX_META   # as they were sent
    back = parse_routes(owners, rows)
    assert len(back) == n and all(back[(s, i)] == (a, e) for s, i, a, e in routes[::997])
    for bad_owners, payload in (("x", b""), ([["a", "b"]], b""), ([], rows[:ROUTE.itemsize]),
                                (owners, rows[:-1])):
        with pytest.raises(InvalidArgument):
            parse_routes(bad_owners, payload)
