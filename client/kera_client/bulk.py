"""Bulk work without the cyclic garbage collector's interruptions.

Turning a page of a thousand streams into routes, or an answer of thousands of
chunks into positions and ``Chunk``s, makes tens of thousands of objects in a
few milliseconds. CPython's collector runs every 700 allocations and, every
hundred runs or so, walks every object the process holds: with 100,000 streams
known that was a third of a producer's or a consumer's CPU (1.8 -> 1.2 s and
1.4 -> 0.9 s of the CPU of writing and reading one record to each of 100,000
streams). ``bulk()`` pauses it for one such step, which never waits on
anything (no ``await`` inside), and lets it run afterwards: the objects of the
step are looked at once, not a dozen times. It nests, across threads too, and
leaves the collector as it found it (a program that turned it off keeps it off).

Pausing is not enough for what stays: the routes of a million streams, a
consumer's positions. The collector's full collections walk everything alive
each time the long-lived objects grew by a quarter, so a client that learns
1,000,000 streams walks its whole heap some ten times over (a quarter of the
CPU of writing one record to each of 1,000,000 streams, five of twenty
seconds). ``settled(n)``, after a step that made ``n`` such entries, counts
them; every ``SETTLE_EVERY`` it collects the young generations (not the old
one: collecting everything made since the last freeze cost 30-50 ms a time,
5 s of a consumer's 17 s of CPU reading 1,000,000 streams) and freezes what
is left (``gc.freeze``), which no collection walks again. The young
collections are made rarer (``kera.collector.GC_THRESHOLDS``, the servers' own)
from the first step that learns ``BIG_STEP`` entries at once (a full page of a
lookup), not only from the first freeze: a process that learns streams by the
thousand allocates millions of objects a second, and until then the default
thresholds collected every 700 (a tenth of a producer's CPU writing one record
to each of 100,000 new streams: 1.15 -> 1.05 s with the thresholds set from the
start). Records parked for streams not known yet count as such entries too
(``lookups``: one ``settled`` per ``BIG_STEP`` streams met): a burst of a
million ``send()``s parks them all before the first lookup answers, and with
CPython's thresholds the growing heap was walked whole a dozen times (the
collector's share of the producer's CPU writing one record to each of
1,000,000 streams 3.3 -> 1.9 s, the burst 3.6 -> 1.9 s). Both are the whole
process's: a program holding a million streams' client is a big client. Reference counting still frees a frozen
object that is dropped; only a cycle frozen while alive and dropped later,
or dropped after it grew old and before the next freeze, is never
reclaimed: at most what one interval of ``SETTLE_EVERY`` entries left.
Figures (1,000,000 streams of one record, one producer, one consumer by
pattern, this process's CPU): writing 14.3 -> 11.8 s, reading 17.4 -> 10.6 s;
with no collector at all, 10.2 s and 10.2 s.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

from kera.collector import GC_THRESHOLDS

_lock = threading.Lock()
_depth = 0
_was_on = True
_unsettled = 0
SETTLE_EVERY = 20_000   # long-lived entries (streams, streamlets) learned between freezes
BIG_STEP = 1_000        # entries learned in one step that make a process a big client at once


@contextmanager
def bulk():
    global _depth, _was_on
    with _lock:
        if _depth == 0:
            _was_on = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_on:
                gc.enable()


def settled(n: int) -> None:
    """``n`` long-lived entries were just made (see the module doc): the big client's
    thresholds from a step of ``BIG_STEP``, frozen every ``SETTLE_EVERY``; nothing while
    the program keeps the collector off, no freeze while a step still runs."""
    global _unsettled
    with _lock:
        on = _was_on if _depth else gc.isenabled()   # the program's choice, a step aside
        _unsettled += n
        due = on and not _depth and _unsettled >= SETTLE_EVERY
        if due:
            _unsettled = 0
    if on and (due or n >= BIG_STEP) and gc.get_threshold()[0] < GC_THRESHOLDS[0]:
        gc.set_threshold(*GC_THRESHOLDS)
    if due:
        gc.collect(1)
        gc.freeze()
