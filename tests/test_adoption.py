"""A dead broker's closed history adopted after the hand-over (``kera.recovery.adoption``): the
streamlet's side of the wait, and what a recovery tells a new owner. The process tests
(cut short, owner and coordinator killed) are in test_retention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from kera import chunk
from kera.broker.streamlet import Streamlet
from kera.errors import Recovering
from kera.position import DONE
from kera.recovery.adoption import Adoptions, key_of

from .conftest import stream_meta


def _streamlet() -> Streamlet:
    sl = Streamlet(stream_meta(groups=2, segment_size=4096), 0)
    for p in range(2):   # groups 0 and 1, one per slot
        sl.append(chunk.build(1, 0, p, 0, [b"r"]), p)
    return sl


def test_reads_reaching_a_pending_group_wait_and_nothing_takes_its_id():
    """Groups 5 and 7 of a dead incarnation (slot 0, then 1) are still to be adopted: a read
    that may reach one (from below it, not past it) is refused as retriable, a read past
    them is served, a consumer from latest takes them as read, new groups are numbered past
    them, a group held older than a pending group of its slot takes no more chunks (the
    other slot's keeps its group), and the producers' sequences in them make a resend a
    duplicate. Once adopted, reads are served."""
    sl = _streamlet()
    sl.recovering = True
    sl.pend((4, 2), [[5, 5]], {9: 41}, {0: 5})
    sl.finish_recovery()
    with pytest.raises(Recovering):
        sl.read(0, {}, 1 << 20)
    with pytest.raises(Recovering):
        sl.read(2, {0: DONE, 1: DONE}, 1 << 20)   # group 5 not read yet
    sl.read(2, {5: DONE}, 1 << 20)                # read from a former owner already
    sl.read(6, {}, 1 << 20)
    low, latest = sl.latest()
    assert low == 0 and latest[5] == DONE and set(latest) == {0, 1, 5}
    assert sl.next_group == 6
    assert sl.groups[0].closed and not sl.groups[1].closed and sl.active == [None, sl.groups[1]]
    g, _, _ = sl.append(chunk.build(1, 0, 0, 1, [b"r"]), 0)   # slot 0: a new group past them
    assert g.id == 6
    assert sl.check_sequence(9, 41) is not None and sl.check_sequence(9, 42) is None
    sl.pend((3, 1), [[7, 7]], {}, {1: 7})         # another incarnation's, on the same streamlet
    assert sl.groups[1].closed and sl.active[1] is None and sl.next_group == 8
    sl.unpend((4, 2))
    with pytest.raises(Recovering):
        sl.read(0, {}, 1 << 20)
    sl.read(0, {7: DONE}, 1 << 20)
    sl.unpend((3, 1))
    assert not sl.pending
    sl.read(0, {}, 1 << 20)


class _Member:   # a broker as a recovery names it (hashable, as ``kera.coordinator.membership.Member``)
    addr, epoch = "b3", 3


class _Streams(dict):   # the coordinator's catalog, as the adoption reads it
    def by_id(self, sid: int):
        return next((s for s in self.values() if s.id == sid), None)


def _adoptions() -> Adoptions:
    meta = {"deferred": {}}

    def put(path, v):
        meta[path[0]][path[1]] = v
    streams = _Streams(s=SimpleNamespace(id=1, groups=4, replication=3))
    return Adoptions(roster=None, metadata=SimpleNamespace(state=meta, set=put, streams=streams),
                     recovered=None, pool=None)


def test_a_recovery_tells_its_new_owners_the_groups_a_record_still_holds():
    """A recovery hands over streamlets one of which has a pending adoption of an earlier
    incarnation (its new owner died before it was done): the new owner is told those groups
    (as ranges of ids, with the newest per slot), beside the recovery's own with their
    sequences; streamlets not handed over are not."""
    ad = _adoptions()
    ad.record(2, 2, {(1, 0): ({3, 4, 9}, {7: 10}, {3: 7, 4: 6, 9: 5}, [77]), (1, 1): ({5}, {}, {5: 0}, [0])}, [[0, 3]], True)
    assert list(ad.records) == [key_of(2, 2)]
    assert ad.records[key_of(2, 2)]["streamlets"] == [[1, 0, [[3, 4], [9, 9]], [[1, 9], [2, 4], [3, 3]], 77],
                                                      [1, 1, [[5, 5]], [[0, 5]], 0]]
    new = _Member()
    got = ad.pending_for({(1, 0): new}, (1, 1), {(1, 0): ({8}, {7: 20}, {8: 7}, [120])})
    assert got == {(new, (1, 1)): [[1, 0, [[8, 8]], [(7, 20)], [[3, 8]], 120]],
                   (new, (2, 2)): [[1, 0, [[3, 4], [9, 9]], [], [[1, 9], [2, 4], [3, 3]], 77]]}
    assert ad.pending_for({(1, 0): new}, (2, 2)) == {}   # its own record: told from its plan


def test_a_second_hand_over_of_the_same_incarnation_adds_to_its_record():
    """A hand-over whose commit was cut short left a record; the incarnation still owned
    other streamlets, recovered again: their pending groups join the record, the first
    hand-over's other streamlets keep theirs, a streamlet handed over again is as the new
    plan says; what the replays covered is the smaller, complete only if both were."""
    ad = _adoptions()
    ad.record(2, 2, {(1, 0): ({3, 4}, {}, {3: 0, 4: 0}, [0]), (1, 2): ({1}, {}, {1: 0}, [0])},
              [[0, 3], [1, 5]], True, [(1, 0), (1, 2)])
    ad.record(2, 2, {(1, 1): ({6}, {}, {6: 1}, [0])}, [[0, 4], [1, 4]], False, [(1, 1), (1, 2)])
    r = ad.records[key_of(2, 2)]
    assert r["streamlets"] == [[1, 0, [[3, 4]], [[0, 4]], 0], [1, 1, [[6, 6]], [[1, 6]], 0]]
    assert r["covered"] == [[0, 3], [1, 4]] and r["complete"] is False
    assert ad.has(2, 2) and not ad.has(2, 3)


def test_appends_while_a_history_is_pending_go_on_past_its_kafka_offsets():
    """A dead incarnation's closed groups hold Kafka offsets 2..49 and are adopted after the
    hand-over: appends made meanwhile go on from 50 (the end a recovery tells ``pend``), the
    adopted rows (a run of chunks is one row) join the index in offset order once adopted,
    and offsets of chunks written before offsets were kept are numbered after the rest."""
    import numpy as np
    sl = _streamlet()   # offsets 0 and 1
    sl.recovering = True
    sl.pend((4, 2), [[5, 5]], {}, {0: 5}, 50)
    sl.finish_recovery()
    sl.append(chunk.build(1, 0, 1, 1, [b"r", b"s"]), 1)
    log = sl.kafka_log()
    assert (log.last_base, log.next) == (50, 52)
    seg = SimpleNamespace(id=0, ends=[100, 300, 340], kafka=(np.array([3, 13, 0], np.uint64),
                                                            np.array([10, 37, 4], np.uint64)))
    log.adopted(5, seg)
    assert seg.kafka is None   # let go once indexed
    sl.unpend((4, 2))
    rows = range(len(log))
    assert [log.base(i) for i in rows] == [0, 1, 2, 12, 50, 52]
    assert [log.end(i) for i in rows] == [1, 2, 12, 49, 52, 56]
    assert log.row(3) == (12, 49, 5, 0, 100, 200) and log.find(30) == 3 and log.next == 56


def test_a_pend_again_from_the_record_carries_the_kafka_end():
    """A new coordinator term (or a failed try) adopts from the record alone: its ``pend``
    tells the owner the end of the pending groups' Kafka offsets, as the hand-over's did, so
    appends meanwhile go on past them; a record written before the end was kept reads as 0."""
    ad = _adoptions()
    ad.record(2, 2, {(1, 0): ({3, 4}, {}, {3: 0, 4: 0}, [120])}, [[0, 3]], False, [(1, 0)])
    ad.records["1:1"] = {"broker": 1, "epoch": 1, "covered": [], "complete": False,
                         "streamlets": [[1, 1, [[6, 6]], [[1, 6]]]]}   # the format before
    new = _Member()
    ad.roster = SimpleNamespace(live_broker=lambda *owner: new)
    ad.metadata.streams["s"].owners = [(3, 3), (3, 3)]
    ad.metadata.delete = lambda path: ad.records.pop(path[1])
    sent = []

    async def call(m, method, meta):
        sent.append((method, meta["source"], meta["entries"]))

    async def repoint(*args):
        pass

    async def commit():
        pass
    ad._call, ad._repoint, ad.metadata.commit = call, repoint, commit
    for k in (key_of(2, 2), "1:1"):
        trio.run(ad._adopt, k, ad.records[k])
    assert sent == [("pend", [2, 2], [[1, 0, [[3, 4]], [], [[0, 4]], 120]]),
                    ("pend", [2, 2], [[1, 0, [], [], []]]),
                    ("pend", [1, 1], [[1, 1, [[6, 6]], [], [[1, 6]], 0]]),
                    ("pend", [1, 1], [[1, 1, [], [], []]])]
    assert not ad.records
