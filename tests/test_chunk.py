"""Chunk format: round trips, build_arrays, damage detection, placement, scan."""

from __future__ import annotations

import time
from itertools import accumulate

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kera import chunk, limits
from kera.chunk import (
    HEADER,
    HEADER_SIZE,
    NO_PLACEMENT,
    ChunkView,
    build,
    build_arrays,
    parse_header,
    place,
    scan,
    verify,
)
from kera.errors import ChecksumError, ProtocolError

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(SETTINGS, max_examples=50)
DAMAGE = (ProtocolError, ChecksumError)

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
records = st.lists(st.tuples(st.none() | st.binary(max_size=20), st.binary(max_size=40), I64),
                   min_size=1, max_size=25)
ids = st.tuples(U64, U32, U64, U64)  # stream_id, streamlet, producer_id, sequence


def make(ident, recs, with_keys=True) -> bytes:
    keys = [k for k, _, _ in recs] if with_keys else None
    return build(*ident, [v for _, v, _ in recs], keys, [t for _, _, t in recs])


def arrays_of(recs):
    keys = [k or b"" for k, _, _ in recs]
    vals = [v for _, v, _ in recs]
    koff = np.array([0, *np.cumsum([len(k) for k in keys], dtype=np.int64)], dtype=np.int64)
    voff = np.array([0, *np.cumsum([len(v) for v in vals], dtype=np.int64)], dtype=np.int64)
    ts = np.array([t for _, _, t in recs], dtype=np.int64)
    return ts, koff, b"".join(keys), voff, b"".join(vals)


def check_view(view: ChunkView, recs, with_keys=True) -> None:
    n = len(recs)
    assert len(view) == n
    assert view.values() == [v for _, v, _ in recs]
    assert view.keys() == ([k or None for k, _, _ in recs] if with_keys else [None] * n)
    assert view.timestamps.tolist() == [t for _, _, t in recs]
    assert view.timestamps.dtype == np.dtype("<i8")
    ts, koff, kbytes, voff, vbytes = arrays_of(recs)
    if not with_keys:
        koff, kbytes = np.zeros(n + 1, dtype=np.int64), b""
    assert view.key_offsets.tolist() == koff.tolist()
    assert view.value_offsets.tolist() == voff.tolist()
    assert bytes(view.key_data) == kbytes
    assert bytes(view.value_data) == vbytes
    assert list(view.records()) == list(zip(view.keys(), view.values(), view.timestamps.tolist(), strict=True))


# --- round trips ---------------------------------------------------------------------------


@SETTINGS
@given(ids, records, st.booleans())
def test_round_trip(ident, recs, with_keys):
    c = make(ident, recs, with_keys)
    h = verify(c)
    assert parse_header(c) == h
    n = len(recs)
    stream_id, streamlet, producer_id, sequence = ident
    assert (h.stream_id, h.streamlet, h.producer_id, h.sequence) == ident
    assert h.record_count == n
    assert h.flags == 0
    assert h.ts_min == min(t for _, _, t in recs)
    assert h.ts_max == max(t for _, _, t in recs)
    assert (h.group, h.segment, h.offset) == (NO_PLACEMENT,) * 3
    raw = sum(len(v) for _, v, _ in recs) + (sum(len(k or b"") for k, _, _ in recs) if with_keys else 0)
    assert h.body_len == (16 * n + 8 + raw + 7) // 8 * 8
    assert h.size == len(c) == HEADER_SIZE + h.body_len
    assert len(c) % 8 == 0
    assert c[HEADER_SIZE + 16 * n + 8 + raw:] == bytes(h.body_len - 16 * n - 8 - raw)  # zero pad
    check_view(ChunkView(c), recs, with_keys)
    check_view(ChunkView(c, 0, h), recs, with_keys)


@SETTINGS
@given(ids, records, st.binary(max_size=30))
def test_view_at_offset_in_larger_buffer(ident, recs, before):
    c = make(ident, recs)
    buf = before + c + b"trailing junk"
    h = verify(buf, len(before))
    check_view(ChunkView(buf, len(before)), recs)
    check_view(ChunkView(memoryview(buf), len(before), h), recs)


def test_empty_values_and_keys():
    recs = [(None, b"", 0), (b"", b"", -1), (b"k", b"", 2**63 - 1), (None, b"v", -(2**63))]
    c = make((1, 2, 3, 4), recs)
    verify(c)
    v = ChunkView(c)
    assert v.values() == [b"", b"", b"", b"v"]
    assert v.keys() == [None, None, b"k", None]  # an empty key reads back as no key
    assert v.timestamps.tolist() == [0, -1, 2**63 - 1, -(2**63)]


def test_default_timestamps_are_now_ms():
    before = int(time.time() * 1000)
    c = build(1, 1, 1, 1, [b"a", b"b", b"c"])
    after = int(time.time() * 1000)
    ts = ChunkView(c).timestamps.tolist()
    assert len(set(ts)) == 1 and before <= ts[0] <= after
    h = verify(c)
    assert h.ts_min == h.ts_max == ts[0]


def test_views_are_zero_copy():
    buf = bytearray(build(1, 1, 1, 1, [b"abc"], [b"k"], [5]))
    v = ChunkView(buf)
    ts = v.timestamps
    buf[HEADER_SIZE:HEADER_SIZE + 8] = (42).to_bytes(8, "little")
    assert ts[0] == 42


def test_build_rejects_bad_counts():
    with pytest.raises(ValueError):
        build(1, 1, 1, 1, [])
    with pytest.raises(ValueError):
        build(1, 1, 1, 1, [b"a", b"b"], keys=[b"k"])
    with pytest.raises(ValueError):
        build(1, 1, 1, 1, [b"a", b"b"], keys=[b"k1", b"k2", b"extra"])
    with pytest.raises(ValueError):
        build(1, 1, 1, 1, [b"a", b"b"], timestamps=[1])
    with pytest.raises(ValueError):
        build(1, 1, 1, 1, [b"a", b"b"], timestamps=[1, 2, 3])


def test_build_arrays_rejects_inconsistent_columns():
    ts = np.array([1, 2], dtype=np.int64)
    off = np.array([0, 1, 2], dtype=np.uint32)
    build_arrays(1, 1, 1, 1, ts, off, b"ab", off, b"cd")  # consistent: fine
    with pytest.raises(ValueError):
        build_arrays(1, 1, 1, 1, ts, off, b"abc", off, b"cd")  # extra key bytes
    with pytest.raises(ValueError):
        build_arrays(1, 1, 1, 1, ts, off, b"ab", off, b"c")  # missing value bytes
    with pytest.raises(ValueError):
        build_arrays(1, 1, 1, 1, ts[:1], off, b"ab", off, b"cd")  # offsets longer than n + 1
    with pytest.raises(ValueError):
        build_arrays(1, 1, 1, 1, ts[:0], off[:1], b"", off[:1], b"")  # no records


# --- build_arrays --------------------------------------------------------------------------


@SETTINGS
@given(ids, records)
def test_build_arrays_equals_build(ident, recs):
    c = make(ident, recs)
    ts, koff, kbytes, voff, vbytes = arrays_of(recs)
    assert build_arrays(*ident, ts, koff, kbytes, voff, vbytes) == c
    # other dtypes / byte orders are normalised to the little-endian layout
    assert build_arrays(*ident, ts.astype(">i8"), koff.astype(np.uint32), kbytes,
                        voff.astype(">u4"), memoryview(vbytes)) == c
    assert build_arrays(*ident, ts, koff.astype(np.uint64), bytearray(kbytes),
                        voff, vbytes) == c


# --- damage --------------------------------------------------------------------------------


@SETTINGS
@given(ids, records, st.data())
def test_any_truncation_detected(ident, recs, data):
    c = make(ident, recs)
    cut = data.draw(st.integers(0, len(c) - 1))
    with pytest.raises(DAMAGE):
        verify(c[:cut])
    if cut == 0:
        assert scan(c[:cut]) == []  # an empty buffer holds no chunks
        return
    with pytest.raises(DAMAGE):
        scan(c[:cut])
    with pytest.raises(DAMAGE):
        scan(c[:cut], verify_bodies=False)


def test_every_truncation_detected():
    for recs in ([(None, b"x", 1)], [(b"key", b"value" * 7, 3), (None, b"", -4)]):
        c = make((9, 8, 7, 6), recs)
        for cut in range(len(c)):
            with pytest.raises(DAMAGE):
                verify(c[:cut])


def flip(buf: bytes, bit: int) -> bytearray:
    out = bytearray(buf)
    out[bit // 8] ^= 1 << (bit % 8)
    return out


@SETTINGS
@given(ids, records, st.booleans(), st.data())
def test_any_bit_flip_detected(ident, recs, placed, data):
    c = bytearray(make(ident, recs))
    if placed:
        place(c, 0, 3, 4, 5)
    bit = data.draw(st.integers(0, 8 * len(c) - 1))
    bad = flip(c, bit)
    with pytest.raises(DAMAGE):
        verify(bad)
    with pytest.raises(DAMAGE):
        scan(bad)
    if bit < 8 * HEADER_SIZE:
        with pytest.raises(DAMAGE):
            parse_header(bad)
    else:
        assert parse_header(bad) == parse_header(c)  # header is fine ...
        with pytest.raises(ChecksumError):            # ... the body checksum catches it
            verify(bad)


@pytest.mark.parametrize("placed", [False, True])
def test_every_bit_flip_detected_exhaustive(placed):
    """All bits of small chunks, including every header field, padding and the checksums."""
    cases = [
        [(None, b"x", 1)],                              # 7 bytes of padding
        [(b"k", b"abc", 5), (None, b"", -1), (b"kk", b"defgh", 2**40)],
        [(b"12345678", b"12345678", 0)],                # no padding
    ]
    for recs in cases:
        c = bytearray(make((2**64 - 1, 2**32 - 1, 7, 8), recs))
        if placed:
            place(c, 0, 1, 2, 3)
        verify(c)
        undetected = []
        for bit in range(8 * len(c)):
            try:
                verify(flip(c, bit))
            except DAMAGE:
                continue
            undetected.append(bit)
        assert undetected == [], f"undetected bit flips at bits {undetected}"


@SETTINGS
@given(st.binary(max_size=300), st.integers(0, 40))
def test_garbage_headers_only_raise_damage(data, offset):
    for fn in (parse_header, verify):
        try:
            fn(data, offset)
        except DAMAGE:
            pass
    try:
        scan(data)
    except DAMAGE:
        pass


@SETTINGS
@given(ids, records, st.data())
def test_garbage_with_valid_magic(ident, recs, data):
    """Random header fields behind a valid magic: only damage errors, never anything else."""
    c = bytearray(make(ident, recs))
    n = data.draw(st.integers(1, 10))
    for _ in range(n):
        i = data.draw(st.integers(2, len(c) - 1))
        c[i] = data.draw(st.integers(0, 255))
    for fn in (parse_header, verify, scan):
        try:
            fn(c)
        except DAMAGE:
            pass


def test_inconsistent_header_rejected_even_with_good_checksum():
    """A header whose checksum is right but whose counts are impossible is refused."""
    good = bytearray(build(1, 1, 1, 1, [b"a"]))
    f = list(HEADER.unpack_from(good))

    def rebuilt(**changes):
        g = list(f)
        for idx, val in changes.items():
            g[int(idx[1:])] = val
        head = bytearray(HEADER.pack(*g))
        place(head, 0, g[10], g[11], g[12])  # recomputes the header checksum
        return bytes(head) + bytes(good[HEADER_SIZE:])

    for bad in (dict(f5=0), dict(f5=limits.MAX_RECORDS + 1), dict(f13=f[13] - 1),
                dict(f13=8), dict(f5=5)):
        with pytest.raises(ProtocolError):
            parse_header(rebuilt(**bad))
    with pytest.raises(ProtocolError):
        parse_header(rebuilt(f1=2))  # version


# --- placement -----------------------------------------------------------------------------


@SETTINGS
@given(ids, records, U32, U32, U32)
def test_place_reads_back(ident, recs, group, segment, offset):
    c = make(ident, recs)
    buf = bytearray(c)
    place(buf, 0, group, segment, offset)
    h = verify(buf)
    assert (h.group, h.segment, h.offset) == (group, segment, offset)
    before = verify(c)
    assert h == before._replace(group=group, segment=segment, offset=offset)
    assert buf[HEADER_SIZE:] == c[HEADER_SIZE:]  # body untouched
    assert buf[:52] == c[:52]  # fields before the placement untouched
    check_view(ChunkView(buf), recs)
    place(buf, 0, 1, 2, 3)  # re-placing works too
    assert (verify(buf).group, verify(buf).segment, verify(buf).offset) == (1, 2, 3)


def test_place_in_concatenation_and_memoryview():
    a = build(1, 1, 1, 1, [b"a" * 3], [b"k"], [1])
    b = build(2, 2, 2, 2, [b"b" * 9, b""], None, [5, 6])
    buf = bytearray(a + b)
    place(memoryview(buf), len(a), 10, 20, 30)
    place(buf, 0, 11, 21, 31)
    hs = scan(buf)
    assert [(h.group, h.segment, h.offset, off) for h, off in hs] == \
        [(11, 21, 31, 0), (10, 20, 30, len(a))]
    assert ChunkView(buf, len(a)).values() == [b"b" * 9, b""]


def test_place_on_immutable_buffer_fails():
    with pytest.raises(TypeError):
        place(build(1, 1, 1, 1, [b"a"]), 0, 1, 2, 3)


# --- scan ----------------------------------------------------------------------------------


@FEW
@given(st.lists(st.tuples(ids, records), min_size=1, max_size=5))
def test_scan_concatenation(chunks):
    cs = [make(ident, recs) for ident, recs in chunks]
    buf = b"".join(cs)
    offsets = np.cumsum([0] + [len(c) for c in cs[:-1]]).tolist()
    for verify_bodies in (True, False):
        got = scan(buf, verify_bodies)
        assert [off for _, off in got] == offsets
        assert [h for h, _ in got] == [verify(c) for c in cs]
    for (h, off), (_, recs) in zip(scan(buf), chunks, strict=True):
        check_view(ChunkView(buf, off, h), recs)


def test_scan_empty():
    assert scan(b"") == []


@FEW
@given(st.lists(st.tuples(ids, records), min_size=2, max_size=4), st.data())
def test_scan_fails_on_damaged_chunk(chunks, data):
    cs = [make(ident, recs) for ident, recs in chunks]
    buf = b"".join(cs)
    j = data.draw(st.integers(0, len(cs) - 1))
    start = sum(len(c) for c in cs[:j])
    bit = data.draw(st.integers(0, 8 * len(cs[j]) - 1))
    bad = flip(buf, 8 * start + bit)
    with pytest.raises(DAMAGE):
        scan(bad)
    if bit < 8 * HEADER_SIZE:  # headers are checked even without body verification
        with pytest.raises(DAMAGE):
            scan(bad, verify_bodies=False)


@FEW
@given(st.lists(st.tuples(ids, records), min_size=1, max_size=3), st.binary(min_size=1, max_size=100))
def test_scan_fails_on_trailing_bytes(chunks, tail):
    buf = b"".join(make(ident, recs) for ident, recs in chunks) + tail
    with pytest.raises(DAMAGE):
        scan(buf)


@pytest.mark.parametrize("n", [3, 12])   # checked without numpy, and with it
def test_inconsistent_offsets_are_refused_by_readers(n):
    """Valid checksums but offsets going backwards or past the data: never sliced."""
    import struct as _struct

    values = [b"abc", b"de", b"f"] * (n // 3)
    good = chunk.build(1, 0, 1, 0, values)
    ends = list(accumulate(map(len, values), initial=0))
    at = chunk.HEADER_SIZE + 8 * n + 4 * (n + 1)  # the value offsets
    for offsets in ([0, 1000, *ends[2:]], [0, 2, 1, *ends[3:]], [5, *ends[1:]]):
        body = bytearray(good[chunk.HEADER_SIZE:])
        _struct.pack_into(f"<{n + 1}I", body, at - chunk.HEADER_SIZE, *offsets)
        bad = chunk.seal(1, 0, 1, 0, n, 0, 0, bytes(body))
        chunk.verify(bad)  # the checksums are right
        with pytest.raises(ProtocolError):
            chunk.ChunkView(bad)
    assert list(chunk.ChunkView(good).values()) == values


# --- many chunks in one pass (the producer's and the broker's per-request paths) ----------


@FEW
@given(st.lists(st.tuples(ids, records, st.sampled_from([0, chunk.SEQ_RESET])), min_size=1, max_size=6),
       st.booleans())
def test_pack_many_equals_build(chunks, with_keys):
    """One pass over many chunks makes the bytes ``build`` makes, chunk after chunk."""
    want = [build(i[0], i[1], 7, i[3], [v for _, v, _ in rs], [k for k, _, _ in rs] if with_keys else None,
                  [t for _, _, t in rs], flags=f) for i, rs, f in chunks]
    recs = [r for _, rs, _ in chunks for r in rs]
    data, starts, sizes = chunk.pack_many(
        [i[0] for i, _, _ in chunks], [i[1] for i, _, _ in chunks], 7, [i[3] for i, _, _ in chunks],
        [f for _, _, f in chunks], [len(rs) for _, rs, _ in chunks], [v for _, v, _ in recs],
        [k for k, _, _ in recs] if with_keys else None, [t for _, _, t in recs])
    assert bytes(data) == b"".join(want)
    assert sizes == [len(w) for w in want]
    assert starts == np.cumsum([0] + sizes[:-1]).tolist()


@FEW
@given(st.lists(st.tuples(ids, records), min_size=1, max_size=5))
def test_scan_headers_matches_scan(chunks):
    buf = b"".join(make(ident, recs) for ident, recs in chunks)
    heads, offs = chunk.scan_headers(buf)
    got = scan(buf)
    assert offs == [off for _, off in got]
    for f in ("flags", "stream_id", "streamlet", "record_count", "producer_id", "sequence", "body_len",
              "body_checksum"):
        assert heads[f].tolist() == [getattr(h, f) for h, _ in got]


def test_scan_headers_empty():
    heads, offs = chunk.scan_headers(b"")
    assert len(heads) == 0 and offs == []


@FEW
@given(st.lists(st.tuples(ids, records), min_size=1, max_size=4), st.data())
def test_scan_headers_raises_what_scan_raises(chunks, data):
    """Any flipped bit or trailing byte: the typed error of the first damaged chunk."""
    buf = b"".join(make(ident, recs) for ident, recs in chunks)
    if data.draw(st.booleans()):
        bad = flip(buf, data.draw(st.integers(0, 8 * len(buf) - 1)))
    else:
        bad = buf + data.draw(st.binary(min_size=1, max_size=100))
    with pytest.raises(DAMAGE) as want:
        scan(bad)
    with pytest.raises(type(want.value), match=str(want.value)):
        chunk.scan_headers(bad)
