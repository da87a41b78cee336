"""Segment files and replica bookkeeping of the backup (no processes, no sockets)."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kera import chunk
from kera.backup import segment_file as sf
from kera.backup.replica import Replica
from kera.errors import InvalidArgument
from kera.iov import IOV_MAX

from .damage import flip_bits

pytestmark = pytest.mark.timeout(60)


def make_chunks(sizes, seq0=0) -> list[bytes]:
    """One chunk per entry; entry = number of records (values of varying length)."""
    return [chunk.build(1, i % 3, 9, seq0 + i, [bytes([i]) * (j % 13 + 1) for j in range(n)])
            for i, n in enumerate(sizes)]


def write_file(path, chunks, closed=False, epoch=1):
    sf.create(path, 7, 2, 5, epoch)
    n = sf.write(path, 0, chunks)
    if closed:
        sf.write(path, n, [], trailer=sf.encode_trailer(n, len(chunks)))
    return n


def bounds(chunks):
    out, pos = [], 0
    for c in chunks:
        out.append((pos, pos + len(c)))
        pos += len(c)
    return out


# -- format ---------------------------------------------------------------------


def test_header_roundtrip_and_damage():
    h = sf.encode_header(1, 2, 3, 4, 5)
    assert len(h) == sf.FILE_HEADER_SIZE
    assert sf.decode_header(h) == sf.FileHeader(1, 2, 3, 4, 5)
    bad = bytearray(h)
    bad[20] ^= 1
    with pytest.raises(Exception, match="checksum"):
        sf.decode_header(bad)
    assert sf.parse_name(sf.file_name(1, 2, 3)) == (1, 2, 3)
    assert sf.parse_name("x.seg") is None


def test_load_roundtrip(tmp_path):
    chunks = make_chunks([1, 5, 3, 40])
    p = str(tmp_path / sf.file_name(7, 2, 5))
    n = write_file(p, chunks)
    ld = sf.load(p)
    assert ld.header.broker == 7 and ld.header.vlog == 2 and ld.header.vseg == 5 and ld.header.epoch == 1
    s = ld.scan
    assert (s.length, s.chunks, s.corrupt, s.closed, s.cut) == (n, 4, [], False, None)
    assert list(zip(s.starts, s.ends, strict=True)) == bounds(chunks)
    assert ld.cut_bytes == 0 and ld.file_size == sf.FILE_HEADER_SIZE + n
    assert sf.read(p, 0, n) == b"".join(chunks)


def test_closed_trailer(tmp_path):
    chunks = make_chunks([2, 2])
    p = str(tmp_path / "a.seg")
    n = write_file(p, chunks, closed=True)
    s = sf.load(p).scan
    assert s.closed and s.length == n and s.chunks == 2
    # an empty, closed segment
    p2 = str(tmp_path / "b.seg")
    write_file(p2, [], closed=True)
    s2 = sf.load(p2).scan
    assert s2.closed and s2.length == 0 and s2.chunks == 0


@pytest.mark.parametrize("cut_into", ["body", "header", "trailer", "zeros"])
def test_torn_tail_is_cut(tmp_path, cut_into):
    chunks = make_chunks([3, 4, 5])
    p = str(tmp_path / "t.seg")
    n = write_file(p, chunks, closed=(cut_into == "trailer"))
    last = bounds(chunks)[-1]
    size = sf.FILE_HEADER_SIZE + n
    if cut_into == "body":
        os.truncate(p, sf.FILE_HEADER_SIZE + last[0] + chunk.HEADER_SIZE + 3)
        want = last[0]
    elif cut_into == "header":
        os.truncate(p, sf.FILE_HEADER_SIZE + last[0] + 10)
        want = last[0]
    elif cut_into == "trailer":
        os.truncate(p, size + 30)
        want = n
    else:  # an extent allocated but never written (power loss): zeros after the last chunk
        with open(p, "ab") as f:
            f.write(bytes(300))
        want = n
    ld = sf.load(p)
    assert ld.scan.length == want and not ld.scan.closed and ld.scan.corrupt == []
    assert os.path.getsize(p) == sf.FILE_HEADER_SIZE + want  # cut on disk
    again = sf.load(p)
    assert again.cut_bytes == 0 and again.scan.length == want


def test_corrupt_body_reported_and_skipped(tmp_path):
    chunks = make_chunks([3, 4, 5, 6])
    p = str(tmp_path / "c.seg")
    n = write_file(p, chunks)
    b = bounds(chunks)
    flip_bits(p, sf.FILE_HEADER_SIZE + b[1][0] + chunk.HEADER_SIZE + 2, 0x10)
    s = sf.load(p).scan
    assert s.length == n and s.chunks == 3 and not s.damaged
    assert [(c["offset"], c["length"]) for c in s.corrupt] == [(b[1][0], len(chunks[1]))]
    assert list(s.starts) == [b[0][0], b[2][0], b[3][0]]


def test_damaged_header_rest_corrupt_not_truncated(tmp_path):
    chunks = make_chunks([3, 4, 5, 6])
    p = str(tmp_path / "d.seg")
    n = write_file(p, chunks)
    b = bounds(chunks)
    flip_bits(p, sf.FILE_HEADER_SIZE + b[2][0] + 30, 1)
    ld = sf.load(p)
    s = ld.scan
    assert s.damaged and s.length == n and s.chunks == 2
    assert [(c["offset"], c["length"]) for c in s.corrupt] == [(b[2][0], n - b[2][0])]
    assert os.path.getsize(p) == sf.FILE_HEADER_SIZE + n  # kept, not a torn tail


def test_damaged_header_before_a_valid_trailer_stops_at_the_trailer(tmp_path):
    """A closed file keeps its true length: the trailer bytes are not counted as chunk area."""
    chunks = make_chunks([3, 4, 5, 6])
    p = str(tmp_path / "t.seg")
    n = write_file(p, chunks, closed=True)
    b = bounds(chunks)
    flip_bits(p, sf.FILE_HEADER_SIZE + b[1][0] + 30, 1)
    s = sf.load(p).scan
    assert s.damaged and s.closed and s.length == n and s.chunks == 1
    assert [(c["offset"], c["length"]) for c in s.corrupt] == [(b[1][0], n - b[1][0])]


def test_damaged_and_torn_file_header(tmp_path):
    p = str(tmp_path / "e.seg")
    write_file(p, make_chunks([1]))
    with open(p, "r+b") as f:
        f.seek(9)
        f.write(b"\xff")
    ld = sf.load(p)
    assert ld.header is None and "file header" in ld.error and os.path.exists(p)
    p2 = str(tmp_path / "f.seg")
    with open(p2, "wb") as f:
        f.write(sf.encode_header(1, 1, 1, 1)[:20])
    ld2 = sf.load(p2)
    assert ld2.header is None and not os.path.exists(p2)


def test_create_never_overwrites(tmp_path):
    p = str(tmp_path / "g.seg")
    sf.create(p, 1, 1, 1, 1, fsync=True)
    with pytest.raises(FileExistsError):
        sf.create(p, 1, 1, 1, 1)
    assert sf.load(p).header is not None


def test_write_many_parts_past_iov_max(tmp_path):
    c = make_chunks([1])[0]
    p = str(tmp_path / "h.seg")
    sf.create(p, 1, 1, 1, 1)
    parts = [memoryview(c)] * (IOV_MAX + 5)
    assert sf.write(p, 0, parts, fsync=True) == len(c) * len(parts)
    assert sf.load(p).scan.chunks == len(parts)


# -- properties ---------------------------------------------------------------------

chunk_sizes = st.lists(st.integers(1, 12), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(sizes=chunk_sizes, closed=st.booleans(), data=st.data())
def test_any_truncation_cut_to_chunk_boundary(sizes, closed, data):
    chunks = make_chunks(sizes)
    area = b"".join(chunks) + (sf.encode_trailer(sum(map(len, chunks)), len(chunks)) if closed else b"")
    cut = data.draw(st.integers(0, len(area)))
    s = sf.scan_area(area[:cut])
    complete = [(a, e) for a, e in bounds(chunks) if e <= cut]
    assert list(zip(s.starts, s.ends, strict=True)) == complete
    assert s.corrupt == [] and not s.damaged
    assert s.length == (complete[-1][1] if complete else 0)
    assert s.closed == (closed and cut == len(area))
    # cut exactly at a chunk boundary (or after the trailer) leaves nothing torn to cut
    assert s.cut == (None if cut in (s.length, len(area)) else s.length)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=chunk_sizes, data=st.data())
def test_any_file_truncation_is_repaired_on_disk(sizes, data):
    chunks = make_chunks(sizes)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "x.seg")
        n = write_file(p, chunks)
        cut = data.draw(st.integers(0, n))
        os.truncate(p, sf.FILE_HEADER_SIZE + cut)
        ld = sf.load(p)
        keep = max([e for _, e in bounds(chunks) if e <= cut], default=0)
        assert ld.scan.length == keep and ld.scan.chunks == sum(e <= cut for _, e in bounds(chunks))
        assert os.path.getsize(p) == sf.FILE_HEADER_SIZE + keep
        assert sf.read(p, 0, keep) == b"".join(chunks)[:keep]


@settings(max_examples=300, deadline=None)
@given(sizes=chunk_sizes, closed=st.booleans(), data=st.data())
def test_any_bit_flip_is_detected_never_served(sizes, closed, data):
    chunks = make_chunks(sizes)
    n = sum(map(len, chunks))
    area = bytearray(b"".join(chunks) + (sf.encode_trailer(n, len(chunks)) if closed else b""))
    pos = data.draw(st.integers(0, len(area) - 1))
    area[pos] ^= 1 << data.draw(st.integers(0, 7))
    s = sf.scan_area(bytes(area))
    assert s.cut is None  # a flip is not a torn tail: nothing silently cut
    assert s.corrupt, "the flip went unnoticed"
    for a, e in zip(s.starts, s.ends, strict=True):
        assert not a <= pos < e, "a chunk holding the flipped bit would be served"
        assert bytes(area[a:e]) in chunks
    hit = [c for c in s.corrupt if c["offset"] <= pos < c["offset"] + c["length"]]
    assert hit, "the corrupt region must cover the flip"


# -- replica bookkeeping ------------------------------------------------------------


def test_replica_reads_skip_corrupt_and_respect_limits():
    chunks = make_chunks([2, 3, 4, 5, 6])
    b = bounds(chunks)
    area = bytearray(b"".join(chunks))
    area[b[2][0] + chunk.HEADER_SIZE] ^= 4  # chunk 2 body
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, sf.file_name(7, 2, 5))
        sf.create(p, 7, 2, 5, 1)
        sf.write(p, 0, [area])
        rep = Replica.from_loaded(sf.load(p), (7, 2, 5))
    assert rep.chunks == 4 and rep.mem_base == rep.length == b[-1][1]
    # whole chunks, at most max_bytes unless the first chunk alone is larger
    assert rep.plan_read(0, 1) == (0, b[0][1], None, b[0][1])
    assert rep.plan_read(0, b[1][1]) == (0, b[1][1], b[2][0], b[2][1])  # stops before the corrupt one
    assert rep.plan_read(b[2][0], 10**6) == (b[2][0], b[2][0], b[2][0], b[2][1])
    assert rep.plan_read(b[3][0], 10**6) == (b[3][0], b[4][1], None, b[4][1])
    assert rep.plan_read(rep.length, 10) == (rep.length, rep.length, None, rep.length)
    with pytest.raises(InvalidArgument):
        rep.plan_read(3, 100)
    with pytest.raises(InvalidArgument):
        rep.plan_read(rep.length + 1, 100)


def test_replica_memory_parts_release():
    chunks = make_chunks([2, 3, 4, 5])
    rep = Replica(1, 1, 1, 1, "/nonexistent")
    payloads = [b"".join(chunks[:2]), chunks[2], chunks[3]]
    for p in payloads:
        mv = memoryview(p)
        rep.append(mv, *chunk.scan_headers(mv))
    assert rep.chunks == 4 and rep.length == sum(map(len, chunks))
    b = bounds(chunks)
    start, stop, _, _ = rep.plan_read(b[1][0], 10**6)
    assert b"".join(bytes(x) for x in rep.memory_parts(start, stop)) == b"".join(chunks[1:])
    rep.flushed = rep.synced = b[2][1]
    assert rep.release(rep.synced) == b[2][1]
    assert rep.mem_base == b[3][0] and rep.memory_bytes == len(chunks[3])
    # below mem_base a read stops at mem_base (that part comes from the file)
    assert rep.plan_read(0, 10**6)[1] == b[2][1]
    assert rep.plan_read(b[3][0], 10**6)[1] == b[3][1]
