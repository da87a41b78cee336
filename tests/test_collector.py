"""The servers' collector: survivors frozen after each collection, a full one reclaims
cycles that died frozen."""

from __future__ import annotations

import gc
import weakref

import pytest

from kera import collector


class Node:
    def __init__(self):
        self.other = None


@pytest.fixture
def restored():
    """The test process's collector as it was, afterwards (thresholds, callbacks, nothing
    frozen)."""
    was, thresholds, callbacks = gc.isenabled(), gc.get_threshold(), list(gc.callbacks)
    gc.enable()
    gc.collect()
    yield
    gc.callbacks[:] = callbacks
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


def test_survivors_are_frozen_and_a_full_collection_reclaims_dead_cycles(restored):
    c = collector.install()
    assert gc.get_threshold() == collector.GC_THRESHOLDS
    a, b = Node(), Node()
    a.other, b.other = b, a          # a cycle, alive
    ref = weakref.ref(a)
    gc.collect(0)
    assert gc.get_freeze_count() > 0 and c.since >= 1   # survivors frozen: walked no more
    del a, b                         # now garbage, but frozen: no young collection sees it
    gc.collect(0)
    assert ref() is not None
    assert not c.due()               # not before FULL_EVERY collections
    c.since = collector.FULL_EVERY
    assert c.due() and ref() is not None   # due: the old objects grew since the last full one
    c.full_now()
    assert ref() is None
    assert c.full == 1 and not c.due() and gc.get_freeze_count() == c.kept


def test_no_freezing_when_turned_off(restored):
    gc.unfreeze()
    c = collector.install(freeze=False)
    gc.collect(0)
    assert gc.get_freeze_count() == 0 and c.since == 1 and not c.due()
