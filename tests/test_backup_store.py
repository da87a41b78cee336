"""The backup's replicate, flush, read and drop rules, on the pure store (no processes, no files).

The wire behaviour of tests/test_backup_service.py rests on these decisions;
here each rule is checked on its own, including that a refusal stores nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from kera import chunk, limits
from kera.backup import segment_file as sf
from kera.backup.replica import Replica, index_runs
from kera.backup.service import BackupService
from kera.backup.store import (
    APPEND,
    CLOSE,
    DUPLICATE,
    EMPTY,
    NEW,
    BackupStore,
)
from kera.errors import BackupError, ChecksumError, Fenced, InvalidArgument
from kera.wire.columns import INDEX_COLUMNS

from .members import SECRET

pytestmark = pytest.mark.timeout(30)

KEY = (7, 2, 5)


def chunks(*records, seq0=0) -> list[bytes]:
    return [chunk.build(1, 0, 9, seq0 + i, [bytes([i]) * (j % 7 + 1) for j in range(n)])
            for i, n in enumerate(records)]


def mv(parts) -> memoryview:
    return memoryview(b"".join(parts))


def state(store: BackupStore) -> tuple:
    """Everything a refused replicate must leave as it was."""
    return (store.holds(), store.committed, store.unflushed, store.memory, len(store.dirty),
            dict(store.broker_epochs))


def test_new_replica_then_append_at_the_end():
    s = BackupStore()
    a, b = chunks(3, 4), chunks(2, seq0=2)
    d = s.replicate(KEY, 1, 0, mv(a), False)
    assert d.kind == NEW and d.length == len(a[0]) + len(a[1]) and d.chunks == 2
    rep = s.replicas[KEY]
    assert d.replica is rep and rep.epoch == 1 and rep.path.endswith(sf.file_name(*KEY))
    assert s.committed == sf.FILE_HEADER_SIZE + d.length and s.unflushed == s.memory == d.length
    assert list(s.dirty) == [rep]
    d2 = s.replicate(KEY, 1, d.length, mv(b), False)
    assert d2.kind == APPEND and d2.length == rep.length == d.length + len(b[0]) and rep.chunks == 3
    assert s.broker_epochs == {7: 1}


def test_empty_replicate_of_an_unknown_replica_stores_nothing():
    s = BackupStore()
    d = s.replicate(KEY, 1, 0, memoryview(b""), False)
    assert (d.kind, d.length) == (EMPTY, 0) and not s.replicas and s.committed == 0


def test_resend_of_held_bytes_is_acknowledged_again():
    s = BackupStore()
    a, b = chunks(3), chunks(5, seq0=1)
    s.replicate(KEY, 1, 0, mv(a), False)
    s.replicate(KEY, 1, len(a[0]), mv(b), False)
    before = state(s)
    for offset, payload in ((0, a), (len(a[0]), b), (0, a + b)):
        d = s.replicate(KEY, 1, offset, mv(payload), False)
        assert d.kind == DUPLICATE and d.length == offset + len(mv(payload))
    assert state(s) == before


def test_gap_or_overlap_refused_with_the_length():
    s = BackupStore()
    a = chunks(3)
    n = len(a[0])
    with pytest.raises(BackupError) as e:  # no replica: it starts at 0
        s.replicate(KEY, 1, 8, mv(a), False)
    assert e.value.length == 0 and not s.replicas
    s.replicate(KEY, 1, 0, mv(a), False)
    before = state(s)
    for offset in (n + 8, 8):  # a gap; a resend straddling the end
        with pytest.raises(BackupError) as e:
            s.replicate(KEY, 1, offset, mv(chunks(1, 2)), False)
        assert e.value.length == n
    assert state(s) == before


def test_close_only_at_the_copys_end():
    s = BackupStore()
    a, b = chunks(3), chunks(4, seq0=1)
    s.replicate(KEY, 1, 0, mv(a + b), False)
    end = len(a[0]) + len(b[0])
    with pytest.raises(BackupError) as e:  # a resend of a prefix cannot close the copy
        s.replicate(KEY, 1, 0, mv(a), True)
    assert e.value.length == end and not s.replicas[KEY].closed
    d = s.replicate(KEY, 1, len(a[0]), mv(b), True)  # a resend reaching the end: only the close is new
    assert (d.kind, d.take, d.length) == (CLOSE, 0, end)
    rep = s.replicas[KEY]
    assert rep.closed and rep.budget == sf.FILE_HEADER_SIZE + end + sf.TRAILER_SIZE
    d = s.replicate(KEY, 1, 0, mv(a + b), True)  # and again: a duplicate
    assert d.kind == DUPLICATE and d.length == end


def test_empty_closed_replica():
    s = BackupStore()
    d = s.replicate(KEY, 1, 0, memoryview(b""), True)
    assert d.kind == NEW and s.replicas[KEY].closed and s.replicas[KEY].length == 0
    assert s.committed == sf.FILE_HEADER_SIZE + sf.TRAILER_SIZE


def test_closed_replica_takes_no_appends():
    s = BackupStore()
    a = chunks(3)
    s.replicate(KEY, 1, 0, mv(a), True)
    before = state(s)
    with pytest.raises(BackupError, match="closed") as e:
        s.replicate(KEY, 1, len(a[0]), mv(chunks(2, seq0=1)), False)
    assert not hasattr(e.value, "length") and state(s) == before


def test_damaged_or_failing_replica_takes_no_appends():
    s = BackupStore()
    rep = Replica(*KEY, 1, "p")
    rep.damaged = rep.created = True
    s.load(rep, 100)
    before = state(s)
    with pytest.raises(BackupError, match="damaged"):
        s.replicate(KEY, 1, 0, mv(chunks(2)), False)
    rep.damaged, rep.error = False, "writing p failed: EIO"
    with pytest.raises(BackupError, match="EIO"):
        s.replicate(KEY, 1, 0, mv(chunks(2)), False)
    assert state(s) == before


def test_fenced_epochs_refused():
    s = BackupStore()
    s.replicate(KEY, 3, 0, memoryview(b""), True)  # a replicate at epoch 3: 1 and 2 are over
    with pytest.raises(Fenced):
        s.replicate((7, 9, 9), 2, 0, mv(chunks(1)), False)
    s.apply_fences({"7": 3})  # the coordinator fenced epoch 3 itself
    with pytest.raises(Fenced):
        s.replicate((7, 9, 9), 3, 0, mv(chunks(1)), False)
    s.replicate((7, 9, 9), 4, 0, mv(chunks(1)), False)
    s.replicate((8, 1, 1), 0, 0, mv(chunks(1)), False)  # other brokers are not fenced
    assert sorted(s.replicas) == [KEY, (7, 9, 9), (8, 1, 1)]
    # a reloaded replica fences the older epochs of its broker
    t = BackupStore()
    rep = Replica(9, 1, 1, 5, "p")
    t.load(rep, 0)
    with pytest.raises(Fenced):
        t.replicate((9, 2, 2), 4, 0, mv(chunks(1)), False)


def test_bad_payload_refused_and_nothing_stored():
    s = BackupStore()
    bad = bytearray(b"".join(chunks(3)))
    bad[-1] ^= 1
    with pytest.raises(ChecksumError, match="nothing stored"):
        s.replicate(KEY, 1, 0, memoryview(bytes(bad)), False)
    with pytest.raises(InvalidArgument, match="not whole"):
        s.replicate(KEY, 1, 0, mv(chunks(3))[:-8], False)
    assert state(s) == ([], 0, 0, 0, 0, {})
    with pytest.raises(InvalidArgument, match="exceeds"):
        s.accept_replicate(KEY, 1, 0, limits.MAX_REPLICATE_PAYLOAD + 1, False)


@pytest.mark.parametrize("limit", ["max_bytes", "max_memory", "max_replicas"])
def test_limits_refused_with_typed_errors_and_nothing_stored(limit):
    a = chunks(3, 3)
    n = len(a[0]) + len(a[1])
    kw = {"max_bytes": sf.FILE_HEADER_SIZE + n + sf.TRAILER_SIZE - 1, "max_memory": n - 1,
          "max_replicas": 1}[limit]
    s = BackupStore(**{limit: kw})
    s.replicate((1, 1, 1), 1, 0, memoryview(b""), True)  # one replica held already
    before = state(s)
    with pytest.raises(BackupError, match={"max_bytes": "--max-bytes", "max_memory": "memory full",
                                           "max_replicas": "replicas already"}[limit]):
        s.replicate(KEY, 1, 0, mv(a), True)
    assert state(s) == before


def test_budget_counts_header_bytes_and_trailer_and_drop_returns_it():
    s = BackupStore(max_bytes=sf.FILE_HEADER_SIZE + 10_000 + sf.TRAILER_SIZE)
    a = chunks(3)
    s.replicate(KEY, 1, 0, mv(a), False)
    s.replicate(KEY, 1, len(a[0]), memoryview(b""), True)
    assert s.committed == sf.FILE_HEADER_SIZE + len(a[0]) + sf.TRAILER_SIZE
    rep = s.drop(KEY)
    assert rep.dropped and s.committed == s.unflushed == s.memory == 0 and not s.dirty
    with pytest.raises(BackupError, match="being dropped"):  # until its file is gone
        s.replicate(KEY, 1, 0, mv(a), False)
    s.dropped(rep)
    assert s.replicate(KEY, 1, 0, mv(a), False).kind == NEW
    assert s.drop((1, 1, 1)) is None


def test_disk_error_refuses_new_replicas_only():
    s = BackupStore()
    a = chunks(3)
    s.replicate(KEY, 1, 0, mv(a), False)
    s.disk_error = "segment directory: ENOSPC"
    with pytest.raises(BackupError, match="disk failing"):
        s.replicate((7, 2, 6), 1, 0, mv(a), False)
    assert s.replicate(KEY, 1, len(a[0]), mv(chunks(2, seq0=1)), False).kind == APPEND


def test_flush_jobs_then_done_release_a_closed_copy():
    s = BackupStore()
    a = chunks(3, 4)
    n = len(a[0]) + len(a[1])
    s.replicate(KEY, 1, 0, mv(a), True)
    rep = s.replicas[KEY]
    assert s.flush_jobs(True) == []  # its file is being created
    rep.created = True
    (job,) = s.flush_jobs(False)
    assert (job.start, job.upto, job.sync) == (0, n, False) and job.trailer is not None
    assert b"".join(job.parts) == b"".join(a)
    s.flush_done(job)
    assert rep.flushed == n and rep.trailer_written and s.unflushed == 0 and rep in s.dirty
    (job,) = s.flush_jobs(True)  # written, not yet fsynced
    assert job.parts == [] and job.trailer is None and job.sync
    s.flush_done(job)
    assert rep.clean and not s.dirty and s.memory == 0 and rep.mem_base == n
    assert s.flush_jobs(True) == []


def test_a_sync_covers_what_was_written_when_it_started():
    """--fsync periodic / write: the fsync runs beside later writes, so it vouches only for
    the bytes (and trailer) written before it started."""
    s = BackupStore()
    a = chunks(3)
    s.replicate(KEY, 1, 0, mv(a), False)
    rep = s.replicas[KEY]
    rep.created = True
    (job,) = s.flush_jobs(False)
    s.flush_done(job)
    (due,) = s.sync_due()
    assert due == (rep, len(a[0]), False)
    b = chunks(2, seq0=1)
    s.replicate(KEY, 1, rep.length, mv(b), True)   # more, and the close, while it runs
    (job,) = s.flush_jobs(False)
    s.flush_done(job)
    s.sync_done(*due)
    assert rep.synced == len(a[0]) and not rep.trailer_synced and rep in s.dirty and s.memory > 0
    (due,) = s.sync_due()
    s.sync_done(*due)
    assert rep.clean and not s.dirty and s.memory == 0 and s.sync_due() == []


def test_flush_failure_is_kept_until_written():
    s = BackupStore()
    s.replicate(KEY, 1, 0, mv(chunks(3)), False)
    rep = s.replicas[KEY]
    rep.created = True
    (job,) = s.flush_jobs(False)
    assert s.flush_failed(rep, "EIO") and not s.flush_failed(rep, "EIO")
    assert s.disk_error == rep.error == "EIO"
    with pytest.raises(BackupError, match="EIO"):
        s.replicate(KEY, 1, rep.length, mv(chunks(1, seq0=1)), False)
    (job,) = s.flush_jobs(True)
    s.flush_done(job)
    assert rep.error is None and rep.clean


def test_read_plan_memory_then_file():
    s = BackupStore()
    a = chunks(3, 4, 5)
    s.replicate(KEY, 1, 0, mv(a), False)
    s.max_memory = 1
    rep = s.replicas[KEY]
    rep.created = True
    _, start, stop, corrupt_at, nxt, in_memory = s.plan_read(KEY, 0, 1 << 20)
    assert (start, stop, corrupt_at, nxt, in_memory) == (0, rep.length, None, rep.length, True)
    for job in s.flush_jobs(True):
        s.flush_done(job)
    s.relieve_memory()  # over --max-memory: what the file holds leaves memory
    assert s.memory == 0
    _, start, stop, _, nxt, in_memory = s.plan_read(KEY, len(a[0]), len(a[1]))
    assert (start, stop, in_memory) == (len(a[0]), len(a[0]) + len(a[1]), False)
    starts, ends = s.chunk_bounds(rep, start, stop)
    assert (starts, ends) == ([start], [stop])
    assert s.read_meta(rep, nxt, None) == {"length": rep.length, "next": stop, "end": False,
                                           "closed": False}
    with pytest.raises(BackupError, match="no replica"):
        s.plan_read((1, 1, 1), 0, 10)


def test_a_closed_replica_keeps_its_index_rows_within_the_bound_and_gives_them_back(monkeypatch):
    s = BackupStore()
    a, b = chunks(3, 4), chunks(2, seq0=2)
    s.replicate(KEY, 1, 0, mv(a), False)
    s.replicate(KEY, 1, len(a[0]) + len(a[1]), mv(b), True)
    rep = s.replicas[KEY]
    rows = np.frombuffer(rep.index.rows, "<u8").reshape(-1, INDEX_COLUMNS)
    heads = [chunk.parse_header(c) for c in a + b]
    assert rows.tolist() == [[st, en - st, h.stream_id, h.streamlet, h.group, h.segment, h.offset,
                              h.producer_id, h.sequence, h.flags, chunk.HEADER.unpack_from(c)[15],
                              h.record_count]
                             for c, st, en, h in zip(a + b, rep.starts, rep.ends, heads, strict=True)]
    runs = index_runs(rows)   # and the rows of its runs of chunks, made once
    assert rep.index.runs == runs.tobytes() and rep.index.marks == ()   # no index chunk
    assert s.index_bytes == rep.index.nbytes == 3 * 96 + len(runs) * 104 and rep.heads is None
    kept = s.index_bytes
    monkeypatch.setattr(limits, "INDEX_CACHE", s.index_bytes + 100)  # no room for another
    other = (7, 2, 6)
    s.replicate(other, 1, 0, mv(a), True)
    assert s.replicas[other].index is None and s.index_bytes == kept
    s.drop(KEY)
    assert s.index_bytes == 0 and rep.index is None


def test_index_runs_join_a_producers_chunks_that_follow_each_other_and_nothing_else():
    """Runs of chunks (what a recovery plans from): consecutive plain chunks of one producer in
    one segment, following each other in the segment and in the vseg, are one row (first
    offsets, sizes summed, the highest sequence) and their count; a flagged chunk, another
    producer, segment or group, a gap, or another vseg's rows start a new row."""
    def row(voff, size, group=2, segment=0, offset=None, producer=5, seq=0, flags=0, kafka=0):
        return [voff, size, 3, 1, group, segment, voff if offset is None else offset, producer, seq,
                flags, kafka, 2]
    rows = [row(0, 10, seq=1), row(10, 20, seq=2), row(30, 5, seq=3),     # one run
            row(35, 7, flags=chunk.CLOSE),                                 # flagged: its own
            row(42, 10, producer=6, seq=1), row(52, 10, producer=6, seq=2),  # another producer
            row(62, 10, producer=6, seq=3, offset=63),                      # a gap in the segment
            row(72, 10, segment=1, offset=0, seq=4),                        # another segment
            row(0, 10, segment=1, offset=10, seq=5), row(10, 10, segment=1, offset=20, seq=6)]
    a = np.array(rows, np.uint64)
    got = index_runs(a[:8]).tolist() + index_runs(a[8:]).tolist()   # rows 8.. are of another vseg
    assert [r[-1] for r in got] == [3, 1, 2, 1, 1, 2]
    assert got[0] == [0, 35, 3, 1, 2, 0, 0, 5, 3, 0, 0, 6, 3]
    assert got[2][:2] == [42, 20] and got[2][8] == 2
    assert got[5] == [0, 20, 3, 1, 2, 1, 10, 5, 6, 0, 0, 4, 2]
    assert [r[-1] for r in index_runs(a).tolist()] == [3, 1, 2, 1, 1, 2]   # 72+10 != 0: no join anyway
    assert index_runs(a[:0]).shape == (0, INDEX_COLUMNS + 1)
    # Kafka offsets (base + 1, 2 records each): chunks following each other in them join,
    # a gap in them (a chunk compacted away, offsets of another partition) starts a new row
    k = np.array([row(0, 10, seq=1, kafka=1), row(10, 10, seq=2, kafka=3), row(20, 10, seq=3, kafka=9),
                  row(30, 10, seq=4, kafka=11)], np.uint64)
    assert [(r[10], r[11], r[-1]) for r in index_runs(k).tolist()] == [(1, 4, 2), (9, 4, 2)]


def test_a_file_read_is_not_served_when_its_replica_is_dropped_meanwhile(tmp_path):
    """Reads of a replica's file run beside the flush rounds (not under the I/O lock): one
    whose replica is dropped before it returns (its file deleted, maybe made again for a new
    copy) is refused, typed, and the replica is not marked corrupt; one that was dropped
    before is refused without reading."""
    svc = BackupService(str(tmp_path), cluster_secret=SECRET)
    rep = Replica(1, 2, 3, 0, str(tmp_path / "1-2-3"))
    svc.store.replicas[rep.key] = rep
    reads = []

    def read():  # the file read, during which the replica is dropped
        reads.append(1)
        svc.store.forget(rep)
        return b"bytes", (0, 5, "read back: not this file")

    async def main():
        with pytest.raises(BackupError, match="dropped"):
            await svc.readback.read_replica(rep, read)
        with pytest.raises(BackupError, match="dropped"):
            await svc.readback.read_replica(rep, read)

    trio.run(main)
    assert reads == [1] and not rep.corrupt
