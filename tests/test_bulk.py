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
