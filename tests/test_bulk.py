"""The client's bulk steps: the collector paused for one step, long-lived entries frozen."""

from __future__ import annotations

import gc

import pytest
from kera_client import bulk as bulk_mod
from kera_client.bulk import BIG_STEP, SETTLE_EVERY, bulk, settled

from kera.collector import GC_THRESHOLDS


@pytest.fixture
def fresh():
    """The collector on and nothing frozen or counted, before and after."""
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.unfreeze()
    bulk_mod._unsettled = 0
    yield
    gc.unfreeze()
    bulk_mod._unsettled = 0
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


def test_bulk_pauses_the_collector_and_nests(fresh):
    with bulk():
        assert not gc.isenabled()
        with bulk():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()   # a program that turned it off keeps it off
    with bulk():
        pass
    assert not gc.isenabled()


def test_settled_freezes_once_enough_entries_were_made(fresh):
    kept = [[i] for i in range(1000)]   # long-lived containers the collector tracks
    settled(SETTLE_EVERY - 1)
    assert gc.get_freeze_count() == 0
    with bulk():   # never inside a step: it is still making them
        settled(10)
    assert gc.get_freeze_count() == 0
    settled(1)     # the count carried over: now past SETTLE_EVERY
    assert gc.get_freeze_count() >= len(kept)
    assert bulk_mod._unsettled == 0


def test_settled_leaves_a_disabled_collector_alone(fresh):
    gc.set_threshold(700, 10, 10)
    gc.disable()
    settled(2 * SETTLE_EVERY)
    assert gc.get_freeze_count() == 0 and not gc.isenabled() and gc.get_threshold() == (700, 10, 10)


def test_a_big_step_makes_young_collections_rarer_at_once(fresh):
    """Small steps leave the program's thresholds alone; the first step that learns a page of
    entries sets the big client's, long before the first freeze."""
    gc.set_threshold(700, 10, 10)
    settled(BIG_STEP - 1)
    assert gc.get_threshold() == (700, 10, 10)
    with bulk():   # inside a step too: the collector is paused, not the program's choice
        settled(BIG_STEP)
    assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() == 0


async def test_a_burst_of_sends_to_streams_not_known_yet_makes_a_big_client(fresh, make_cluster):
    """Records parked for streams met by the thousand, before any lookup answers, are long-lived
    entries too: the thousandth stream met sets the big client's thresholds (with CPython's
    the heap of a million parked records was walked whole a dozen times as it grew: 0.9 s of
    the producer's CPU writing one record to each of 1,000,000 streams)."""
    import trio
    from kera_client import open_producer

    from .workload import create

    cluster = make_cluster(1)
    names = [f"b{i:04d}" for i in range(BIG_STEP)]
    with trio.fail_after(60):
        await create(cluster.coordinator, names, replication=1)
        async with open_producer(cluster.coordinator) as p:
            gc.set_threshold(700, 10, 10)
            for s in names[:-1]:
                await p.send(s, b"v")
            assert gc.get_threshold() == (700, 10, 10) and len(p.lookups.parked) == BIG_STEP - 1
            await p.send(names[-1], b"v")
            assert gc.get_threshold() == GC_THRESHOLDS
            await p.flush()
            assert p.acked == BIG_STEP
