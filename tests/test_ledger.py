"""The broker's ledger: what it keeps over all its streamlets as they change, so that its stats,
its reclaim pass and its compactor never walk every streamlet it owns."""

from __future__ import annotations

from kera import chunk
from kera.broker.ledger import Ledger
from kera.broker.streamlet import Streamlet

from .conftest import stream_meta


def test_the_ledger_counts_as_streamlets_change_and_names_only_those_the_passes_need():
    ledger = Ledger()
    shape = {"segment_size": 4096, "group_segments": 4}
    sls = [Streamlet(stream_meta(id=i, **shape), 0, None, ledger) for i in range(100)]
    kept = Streamlet(stream_meta(id=100, retention_bytes=1, **shape), 0, None, ledger)
    compacted = Streamlet(stream_meta(id=101, cleanup_policy="compact", **shape), 0, None, ledger)
    assert ledger.expiring == {} and list(ledger.compacted) == [compacted]
    every = [*sls, kept, compacted]
    for i, sl in enumerate(every):
        for seq in range(1 + i % 3):
            sl.append(chunk.build(sl.stream_id, 0, 7, seq, [b"v" * 100]), 7)
    assert (ledger.chunks, ledger.bytes) == (sum(s.appended_chunks for s in every),
                                             sum(s.appended_bytes for s in every))
    assert ledger.expiring == {}   # nothing filled yet
    big = [b"v" * 3000]
    for sl in (sls[0], kept):      # a chunk that does not fit: their first segments are filled
        sl.append(chunk.build(sl.stream_id, 0, 7, 9, big), 7)
        sl.append(chunk.build(sl.stream_id, 0, 7, 10, big), 7)
    assert list(ledger.expiring) == [kept]   # retention looks at it, not at the plain one
    sls[0].configure(stream_meta(id=0, retention_ms=60_000, **shape))
    assert list(ledger.expiring) == [kept, sls[0]]
    compacted.configure(stream_meta(id=101, **shape))
    assert ledger.compacted == {}
    chunks, nbytes = ledger.chunks, ledger.bytes
    gone = kept.leave()
    assert gone and list(ledger.expiring) == [sls[0]]
    assert (ledger.chunks, ledger.bytes) == (chunks - kept.appended_chunks, nbytes - kept.appended_bytes)
