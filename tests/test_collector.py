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
def servers_collector():
    was, thresholds, callbacks = gc.isenabled(), gc.get_threshold(), list(gc.callbacks)
    gc.enable()
    gc.collect()
    yield collector.install()
    gc.callbacks[:] = callbacks
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


def test_survivors_are_frozen_and_a_full_collection_reclaims_dead_cycles(servers_collector):
    c = servers_collector
    assert gc.get_threshold() == collector.GC_THRESHOLDS
    a, b = Node(), Node()
    a.other, b.other = b, a          # a cycle, alive
    ref = weakref.ref(a)
    gc.collect(0)
    assert gc.get_freeze_count() > 0 and c.since >= 1   # survivors frozen: walked no more
    del a, b                         # now garbage, but frozen: no young collection sees it
    gc.collect(0)
    assert ref() is not None
    assert not c.due()               # not before FULL_EVERY young collections
    c.since = collector.FULL_EVERY
    assert c.due()                   # and the old objects grew since the last full one
    assert ref() is not None
    c.full_now()
    assert ref() is None
    assert c.full == 1 and not c.due() and gc.get_freeze_count() == c.kept


def test_no_freezing_when_turned_off():
    was, callbacks = gc.get_threshold(), list(gc.callbacks)
    try:
        gc.unfreeze()
        c = collector.install(freeze=False)
        gc.collect(0)
        assert gc.get_freeze_count() == 0 and c.since == 1 and not c.due()
    finally:
        gc.callbacks[:] = callbacks
        gc.set_threshold(*was)
