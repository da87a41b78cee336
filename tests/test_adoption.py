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
    consumer from latest takes them as read, new groups are numbered past them, and the
    producers' sequences in them make a resend a duplicate. Once adopted, reads are served."""
    sl = _streamlet()
    sl.pend((4, 2), [5, 7], {9: 41})
    with pytest.raises(Recovering):
        sl.read(0, {}, 1 << 20)
    with pytest.raises(Recovering):
        sl.read(6, {0: DONE, 1: DONE}, 1 << 20)   # group 7 not read yet
    sl.read(6, {7: DONE}, 1 << 20)                # read from a former owner already
    sl.read(8, {}, 1 << 20)
    _, latest = sl.latest()
    assert latest[5] == latest[7] == DONE
    assert sl.next_group == 8
    assert sl.check_sequence(9, 41) is not None and sl.check_sequence(9, 42) is None
    sl.pend((3, 1), [2], {})                      # another incarnation's, on the same streamlet
    sl.unpend((4, 2))
    with pytest.raises(Recovering):
        sl.read(0, {}, 1 << 20)
    sl.unpend((3, 1))
    assert not sl.pending
    sl.read(0, {}, 1 << 20)


class _Member:   # a broker as a recovery names it (hashable, as ``kera.membership.Member``)
    addr, epoch = "b3", 3


def test_a_recovery_tells_its_new_owners_the_groups_a_record_still_holds():
    """A recovery hands over streamlets one of which has a pending adoption of an earlier
    incarnation (its new owner died before it was done): the new owner is told those groups
    with their sequences, beside the recovery's own; streamlets not handed over are not."""
    meta = {"deferred": {}}
    coord = SimpleNamespace(meta=meta, log=SimpleNamespace(set=lambda path, v: meta[path[0]].__setitem__(path[1], v)))
    ad = Adoptions(coord)
    ad.record(2, 2, {(1, 0): ({3, 4}, {7: 10}), (1, 1): ({5}, {})}, [[0, 3]], True)
    assert list(meta["deferred"]) == [key_of(2, 2)]
    new = _Member()
    got = ad.pending_for({(1, 0): new}, (1, 1), {(1, 0): ({8}, {7: 20})})
    assert got == {(new, (1, 1)): [[1, 0, [8], [(7, 20)]]],
                   (new, (2, 2)): [[1, 0, [3, 4], [(7, 10)]]]}
    assert ad.pending_for({(1, 0): new}, (2, 2)) == {}   # its own record: told from its plan
