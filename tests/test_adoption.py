"""A dead broker's closed history adopted after the hand-over (``kera.adoption``): the
streamlet's side of the wait, and what a recovery tells a new owner. The process tests
(cut short, owner and coordinator killed) are in test_retention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kera import chunk
from kera.adoption import Adoptions, key_of
from kera.broker.streamlet import Streamlet
from kera.errors import Recovering
from kera.position import DONE

from .conftest import stream_meta


def _streamlet() -> Streamlet:
    sl = Streamlet(stream_meta(groups=2, segment_size=4096), 0)
    for p in range(2):   # groups 0 and 1, one per slot
        sl.append(chunk.build(1, 0, p, 0, [b"r"]), p)
    return sl


def test_reads_reaching_a_pending_group_wait_and_nothing_takes_its_id():
    """Groups 5 and 7 of a dead incarnation are still to be adopted: a read that may reach
    one (from below it, not past it) is refused as retriable, a read past them is served, a
    consumer from latest starts past them, new groups are numbered past them, the groups
    held below the newest pending one take no more chunks, and the producers' sequences in
    them make a resend a duplicate. Once adopted, reads are served."""
    sl = _streamlet()
    sl.recovering = True
    sl.pend((4, 2), [[5, 5], [7, 7]], {9: 41})
    sl.finish_recovery()
    with pytest.raises(Recovering):
        sl.read(0, {}, 1 << 20)
    with pytest.raises(Recovering):
        sl.read(6, {0: DONE, 1: DONE}, 1 << 20)   # group 7 not read yet
    sl.read(6, {7: DONE}, 1 << 20)                # read from a former owner already
    sl.read(8, {}, 1 << 20)
    low, latest = sl.latest()   # groups 0 and 1 are not durable to their end yet: read on
    assert low == 0 and latest[5] == latest[7] == DONE and set(latest) == {0, 1, 5, 7}
    assert sl.next_group == 8
    assert sl.groups[0].closed and sl.groups[1].closed and sl.active == [None, None]
    g, _, _ = sl.append(chunk.build(1, 0, 0, 1, [b"r"]), 0)
    assert g.id == 8
    assert sl.check_sequence(9, 41) is not None and sl.check_sequence(9, 42) is None
    assert sl.latest()[1][8] == sl.groups[8].durable_end()
    sl.pend((3, 1), [[2, 3]], {})                 # another incarnation's, on the same streamlet
    sl.unpend((4, 2))
    with pytest.raises(Recovering):
        sl.read(0, {}, 1 << 20)
    sl.read(0, {2: DONE, 3: DONE}, 1 << 20)
    sl.unpend((3, 1))
    assert not sl.pending
    sl.read(0, {}, 1 << 20)


class _Member:   # a broker as a recovery names it (hashable, as ``kera.membership.Member``)
    addr, epoch = "b3", 3


def _adoptions() -> Adoptions:
    meta = {"deferred": {}}

    def put(path, v):
        meta[path[0]][path[1]] = v
    return Adoptions(SimpleNamespace(meta=meta, log=SimpleNamespace(set=put)))


def test_a_recovery_tells_its_new_owners_the_groups_a_record_still_holds():
    """A recovery hands over streamlets one of which has a pending adoption of an earlier
    incarnation (its new owner died before it was done): the new owner is told those groups
    (as ranges of ids), beside the recovery's own with their sequences; streamlets not
    handed over are not."""
    ad = _adoptions()
    ad.record(2, 2, {(1, 0): ({3, 4, 9}, {7: 10}), (1, 1): ({5}, {})}, [[0, 3]], True)
    assert list(ad.records) == [key_of(2, 2)]
    assert ad.records[key_of(2, 2)]["streamlets"] == [[1, 0, [[3, 4], [9, 9]]], [1, 1, [[5, 5]]]]
    new = _Member()
    got = ad.pending_for({(1, 0): new}, (1, 1), {(1, 0): ({8}, {7: 20})})
    assert got == {(new, (1, 1)): [[1, 0, [[8, 8]], [(7, 20)]]],
                   (new, (2, 2)): [[1, 0, [[3, 4], [9, 9]], []]]}
    assert ad.pending_for({(1, 0): new}, (2, 2)) == {}   # its own record: told from its plan


def test_a_second_hand_over_of_the_same_incarnation_adds_to_its_record():
    """A hand-over whose commit was cut short left a record; the incarnation still owned
    other streamlets, recovered again: their pending groups join the record (nothing of the
    first is dropped), what the replays covered is the larger, complete only if both were."""
    ad = _adoptions()
    ad.record(2, 2, {(1, 0): ({3, 4}, {})}, [[0, 3], [1, 5]], True)
    ad.record(2, 2, {(1, 1): ({6}, {})}, [[0, 4]], False)
    r = ad.records[key_of(2, 2)]
    assert r["streamlets"] == [[1, 0, [[3, 4]]], [1, 1, [[6, 6]]]]
    assert r["covered"] == [[0, 4], [1, 5]] and r["complete"] is False
    assert ad.has(2, 2) and not ad.has(2, 3)
