"""Frame codec: round trips, arbitrary splits, pipelining, limits, garbage."""

from __future__ import annotations

import array
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kera import frame
from kera.errors import FrameTooLarge, KeraError, ProtocolError
from kera.frame import (
    ERROR,
    KINDS,
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    REQUEST,
    RESPONSE,
    VERSION,
    FrameDecoder,
    encode,
    encode_parts,
)
from kera.limits import MAX_FRAME, MAX_META

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(SETTINGS, max_examples=50)

# msgpack-able values that come back equal: str keys, ints, bytes, str, lists, nested maps.
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.binary(max_size=40) | st.text(max_size=20)
           | st.floats(allow_nan=False))
values = st.recursive(scalars,
                      lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                      max_leaves=8)
metas = st.dictionaries(st.text(max_size=12), values, max_size=5)
payloads = st.binary(max_size=200)
kinds = st.sampled_from(KINDS)
rids = st.integers(0, 2**32 - 1)
frames = st.tuples(kinds, rids, metas, payloads)


def drain(dec: FrameDecoder) -> list:
    out = []
    while (f := dec.next()) is not None:
        out.append(f)
    return out


def same(f, kind, rid, meta, payload) -> None:
    assert f.kind == kind
    assert f.request_id == rid
    assert f.meta == meta
    assert isinstance(f.payload, memoryview)
    assert bytes(f.payload) == bytes(payload)


def prefix(magic=MAGIC, version=VERSION, kind=REQUEST, rid=7, mlen=1, plen=0) -> bytes:
    return PREFIX.pack(magic, version, kind, rid, mlen, plen)


# --- round trips ---------------------------------------------------------------------------


def test_prefix_size():
    assert PREFIX_SIZE == 16
    assert len(encode(REQUEST, 1, {})) == 16 + 1  # empty map is one msgpack byte


@SETTINGS
@given(frames)
def test_round_trip_single(fr):
    kind, rid, meta, payload = fr
    data = encode(kind, rid, meta, payload)
    assert len(data) == PREFIX_SIZE + len(msgpack.packb(meta, use_bin_type=True)) + len(payload)
    dec = FrameDecoder()
    dec.feed(data)
    f = dec.next()
    same(f, *fr)
    assert dec.next() is None
    assert dec.pending == 0


def fed(dec: FrameDecoder, stream: bytes, cuts: list[int]):
    """Feed ``stream`` cut at ``cuts`` (then its end): after each feed, the cut and every
    frame out so far."""
    got, prev = [], 0
    for cut in cuts + [len(stream)]:
        dec.feed(stream[prev:cut])
        prev = cut
        got += drain(dec)
        yield cut, got


@FEW
@given(st.lists(frames, min_size=1, max_size=5), st.data())
def test_pipelined_arbitrary_splits(frs, data):
    """Back-to-back frames fed in hypothesis-chosen pieces: order, ids and contents preserved,
    and after every feed exactly the complete frames have come out (never a partial one)."""
    encoded = [encode(*fr) for fr in frs]
    stream = b"".join(encoded)
    ends = np.cumsum([len(e) for e in encoded]).tolist()
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=12))))
    dec = FrameDecoder()
    for cut, got in fed(dec, stream, cuts):
        assert len(got) == sum(1 for e in ends if e <= cut)
        assert dec.pending == cut - (ends[len(got) - 1] if got else 0)
    assert len(got) == len(frs)
    for f, fr in zip(got, frs, strict=True):
        same(f, *fr)
    assert dec.pending == 0


@FEW
@given(st.lists(st.sampled_from([0, 100, frame.GATHER - 40, frame.GATHER, 5 * frame.GATHER]), min_size=1, max_size=4),
       st.data())
def test_large_frames_any_split(sizes, data):
    """Large frames (gathered piece by piece) between small ones, cut anywhere: the same frames,
    whole, payloads intact after later feeds and backed by bytes (unchanging), ``pending`` exact."""
    rng = np.random.default_rng(len(sizes))
    frs = [(REQUEST, i, {"i": i}, rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for i, n in enumerate(sizes)]
    stream = b"".join(encode(*fr) for fr in frs)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=20))))
    dec = FrameDecoder()
    for cut, got in fed(dec, stream, cuts):
        assert dec.pending == cut - sum(len(encode(*fr)) for fr in frs[:len(got)])
    for f, fr in zip(got, frs, strict=True):
        same(f, *fr)
        assert type(f.payload.obj) is bytes
    assert len(got) == len(frs)


@FEW
@given(st.lists(st.sampled_from([0, 100, frame.GATHER - 40, frame.GATHER, 5 * frame.GATHER]), min_size=1, max_size=4),
       st.data())
def test_bytes_are_read_where_they_lie_and_other_buffers_copied(sizes, data):
    """Bytes fed are parsed in place (never changing, they may be kept as views); a bytearray
    fed may be reused by its owner at once: zeroing every one after its feed changes no frame."""
    rng = np.random.default_rng(len(sizes))
    frs = [(REQUEST, i, {"i": i}, rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for i, n in enumerate(sizes)]
    stream = b"".join(encode(*fr) for fr in frs)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))) + [len(stream)]
    dec, got, prev = FrameDecoder(), [], 0
    for cut in cuts:
        piece = stream[prev:cut]
        if data.draw(st.booleans()):
            reused = bytearray(piece)
            dec.feed(reused)
            reused[:] = bytes(len(reused))
        else:
            dec.feed(piece)
        prev = cut
        got += drain(dec)
    assert len(got) == len(frs) and dec.pending == 0
    for f, fr in zip(got, frs, strict=True):
        same(f, *fr)


@FEW
@given(st.lists(frames, min_size=1, max_size=3))
def test_byte_at_a_time(frs):
    stream = b"".join(encode(*fr) for fr in frs)
    dec = FrameDecoder()
    got = []
    for i in range(len(stream)):
        dec.feed(stream[i:i + 1])
        got += drain(dec)
    assert [(f.kind, f.request_id) for f in got] == [(k, r) for k, r, _, _ in frs]
    for f, fr in zip(got, frs, strict=True):
        same(f, *fr)


@SETTINGS
@given(frames, st.data())
def test_truncated_frame_needs_more(fr, data):
    """Any strict prefix of a frame yields None (never a wrong frame); the rest completes it."""
    enc = encode(*fr)
    cut = data.draw(st.integers(0, len(enc) - 1))
    dec = FrameDecoder()
    dec.feed(enc[:cut])
    assert dec.next() is None
    assert dec.next() is None  # idempotent
    assert dec.pending == cut
    dec.feed(enc[cut:])
    same(dec.next(), *fr)
    assert dec.next() is None


def test_every_truncation_of_one_frame():
    fr = (RESPONSE, 99, {"a": [1, b"x", "y"], "n": -5}, bytes(range(50)))
    enc = encode(*fr)
    for cut in range(len(enc)):
        dec = FrameDecoder()
        dec.feed(enc[:cut])
        assert dec.next() is None
    dec = FrameDecoder()
    dec.feed(enc + enc[:-1])
    same(dec.next(), *fr)
    assert dec.next() is None
    dec.feed(enc[-1:])
    same(dec.next(), *fr)


@SETTINGS
@given(kinds, rids, metas, st.lists(st.binary(max_size=50), max_size=6))
def test_encode_parts_equals_encode(kind, rid, meta, parts):
    joined = b"".join(parts)
    assert encode_parts(kind, rid, meta, parts) == encode(kind, rid, meta, joined)
    mixed = [memoryview(p) if i % 3 == 0 else bytearray(p) if i % 3 == 1 else p
             for i, p in enumerate(parts)]
    assert encode_parts(kind, rid, meta, mixed) == encode(kind, rid, meta, joined)
    dec = FrameDecoder()
    dec.feed(encode_parts(kind, rid, meta, mixed))
    same(dec.next(), kind, rid, meta, joined)


def test_multibyte_item_buffers_length_is_in_bytes():
    """numpy arrays, array.array and typed memoryviews: the prefix counts bytes, not items."""
    arr = np.arange(5, dtype=np.int64)
    arr_u32 = array.array("I", [1, 2, 3])
    for payload in (arr, arr_u32, memoryview(arr_u32), memoryview(arr).cast("B")):
        raw = memoryview(payload).tobytes()
        enc = encode(REQUEST, 3, {"k": 1}, payload)
        dec = FrameDecoder()
        dec.feed(enc)
        same(dec.next(), REQUEST, 3, {"k": 1}, raw)
        assert dec.pending == 0
    parts = [arr, arr_u32, b"tail"]
    raw = b"".join(memoryview(p).tobytes() for p in parts)
    enc = encode_parts(RESPONSE, 4, {}, parts)
    assert enc == encode(RESPONSE, 4, {}, raw)


def test_payload_survives_later_feeds():
    a = encode(REQUEST, 1, {"i": 1}, b"A" * 100)
    b = encode(REQUEST, 2, {"i": 2}, b"B" * 100)
    dec = FrameDecoder()
    dec.feed(a + b[:10])
    f1 = dec.next()
    dec.feed(b[10:])
    f2 = dec.next()
    dec.feed(a)
    f3 = dec.next()
    assert bytes(f1.payload) == b"A" * 100
    assert bytes(f2.payload) == b"B" * 100
    assert bytes(f3.payload) == b"A" * 100


def test_large_pipelined_frames_compaction():
    """Frames past 1 MiB exercise the buffer compaction path."""
    frs = [(REQUEST, i, {"i": i}, bytes([i]) * 700_000) for i in range(4)]
    stream = b"".join(encode(*fr) for fr in frs)
    dec = FrameDecoder()
    dec.feed(stream)
    got = drain(dec)
    assert len(got) == 4
    for f, fr in zip(got, frs, strict=True):
        same(f, *fr)
    dec = FrameDecoder()
    got = []
    step = 333_333
    for i in range(0, len(stream), step):
        dec.feed(stream[i:i + step])
        got += drain(dec)
    assert [f.request_id for f in got] == [0, 1, 2, 3]
    for f, fr in zip(got, frs, strict=True):
        same(f, *fr)


def test_request_ids_boundaries():
    for rid in (0, 1, 2**31, 2**32 - 1):
        dec = FrameDecoder()
        dec.feed(encode(ERROR, rid, {"code": "x"}))
        assert dec.next().request_id == rid


# --- limits -------------------------------------------------------------------------------


def _peak_during(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_4gib_payload_rejected_from_prefix_alone():
    dec = FrameDecoder()

    def run():
        dec.feed(prefix(plen=0xFFFFFFFF))
        with pytest.raises(FrameTooLarge):
            dec.next()

    assert _peak_during(run) < 64 * 1024
    assert issubclass(FrameTooLarge, ProtocolError)


def test_4gib_payload_under_huge_limit_waits_without_allocating():
    dec = FrameDecoder(max_frame=1 << 40)

    def run():
        dec.feed(prefix(mlen=1, plen=0xFFFFFFFF) + b"\x80")
        assert dec.next() is None
        assert dec.next() is None

    assert _peak_during(run) < 64 * 1024


@pytest.mark.parametrize("mlen", [MAX_META + 1, 0xFFFFFFFF])
def test_meta_over_max_meta_rejected(mlen):
    dec = FrameDecoder(max_frame=1 << 40)  # meta limit applies whatever the frame limit

    def run():
        dec.feed(prefix(mlen=mlen, plen=0))
        with pytest.raises(FrameTooLarge):
            dec.next()

    assert _peak_during(run) < 64 * 1024


def test_meta_at_max_meta_accepted():
    big = "x" * (MAX_META - 10)
    meta = {"s": big}
    m = msgpack.packb(meta, use_bin_type=True)
    assert len(m) <= MAX_META
    dec = FrameDecoder()
    dec.feed(encode(REQUEST, 1, meta))
    assert dec.next().meta == meta


def test_max_frame_boundary():
    meta = {}
    enc = encode(REQUEST, 1, meta, b"p" * 100)
    exact = FrameDecoder(max_frame=len(enc))
    exact.feed(enc)
    assert bytes(exact.next().payload) == b"p" * 100
    small = FrameDecoder(max_frame=len(enc) - 1)
    small.feed(enc[:PREFIX_SIZE])  # the prefix alone is enough to refuse
    with pytest.raises(FrameTooLarge):
        small.next()


def test_default_limit():
    dec = FrameDecoder()
    assert dec.max_frame == MAX_FRAME
    dec.feed(prefix(mlen=1, plen=MAX_FRAME - PREFIX_SIZE))
    with pytest.raises(FrameTooLarge):
        dec.next()
    dec = FrameDecoder()
    dec.feed(prefix(mlen=1, plen=MAX_FRAME - PREFIX_SIZE - 1))
    assert dec.next() is None  # allowed, just incomplete


# --- malformed prefixes and meta ------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    dict(magic=b"KG"), dict(magic=b"\x00\x00"), dict(magic=b"FK"),
    dict(version=0), dict(version=2), dict(version=255),
    dict(kind=0), dict(kind=4), dict(kind=255),
])
def test_bad_prefix_rejected(bad):
    dec = FrameDecoder()
    dec.feed(prefix(**bad) + b"\x80")
    with pytest.raises(ProtocolError) as ei:
        dec.next()
    assert not isinstance(ei.value, FrameTooLarge)
    # refused from the prefix alone, even when the rest never comes
    dec = FrameDecoder()
    dec.feed(prefix(**{**bad, "plen": 1000}))
    with pytest.raises(ProtocolError):
        dec.next()


@pytest.mark.parametrize("meta", [[1, 2], 5, "x", None, b"raw", True, 1.5, []])
def test_meta_not_a_map_rejected(meta):
    dec = FrameDecoder()
    dec.feed(encode(REQUEST, 1, meta, b"payload"))
    with pytest.raises(ProtocolError, match="not a map"):
        dec.next()


@pytest.mark.parametrize("mbytes", [
    b"",                      # empty meta
    b"\x81",                  # map header with no entries following
    b"\x80\x80",              # trailing extra data inside meta
    b"\xc1",                  # never-used msgpack byte
    b"\x81\xa1",              # truncated key
    b"\x81\xa2\xff\xfe\x01",  # invalid utf-8 key
    b"\x81\x91\x01\x01",      # unhashable (list) map key
    b"\xdf\xff\xff\xff\xff",  # map announcing 4G entries in 5 bytes
])
def test_undecodable_meta_rejected(mbytes):
    dec = FrameDecoder()
    dec.feed(prefix(mlen=len(mbytes), plen=3) + mbytes + b"abc")
    with pytest.raises(ProtocolError):
        dec.next()


# --- garbage --------------------------------------------------------------------------------


def _run_garbage(data: bytes, chunks: list[int]) -> None:
    """Feed garbage in pieces; next() may give frames, None or ProtocolError, nothing else."""
    dec = FrameDecoder()
    pos = 0
    for size in chunks + [len(data)]:
        dec.feed(data[pos:pos + size])
        pos += size
        for _ in range(len(data) + 2):  # each frame consumes >= 16 bytes: bounded, no hang
            try:
                f = dec.next()
            except ProtocolError:
                return
            except Exception as e:  # pragma: no cover - this is the failure being tested
                pytest.fail(f"garbage raised {type(e).__name__}: {e}")
            if f is None:
                break
            assert f.kind in KINDS
            assert isinstance(f.meta, dict)
        else:  # pragma: no cover
            pytest.fail("decoder does not make progress")
        if pos >= len(data):
            return


@SETTINGS
@given(st.binary(max_size=200), st.lists(st.integers(1, 50), max_size=5))
def test_random_garbage(data, chunks):
    _run_garbage(data, chunks)


@st.composite
def plausible_garbage(draw):
    """A valid-looking prefix whose lengths fit, followed by random meta/payload bytes."""
    meta = draw(st.binary(max_size=40))
    payload = draw(st.binary(max_size=40))
    kind = draw(st.sampled_from([*KINDS, 0, 9]))
    mlen = draw(st.sampled_from([len(meta), max(0, len(meta) - 1), len(meta) + 1]))
    head = PREFIX.pack(MAGIC, VERSION, kind, draw(rids), mlen, len(payload))
    tail = draw(st.binary(max_size=40))
    return head + meta + payload + tail


@SETTINGS
@given(plausible_garbage(), st.lists(st.integers(1, 30), max_size=5))
def test_plausible_garbage(data, chunks):
    _run_garbage(data, chunks)


@FEW
@given(st.lists(frames, min_size=1, max_size=3), st.data())
def test_corrupted_stream_never_other_exception(frs, data):
    stream = bytearray(b"".join(encode(*fr) for fr in frs))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(stream) - 1))
        stream[i] = data.draw(st.integers(0, 255))
    _run_garbage(bytes(stream), data.draw(st.lists(st.integers(1, 40), max_size=4)))


def test_short_garbage_needs_more():
    for n in range(PREFIX_SIZE):
        dec = FrameDecoder()
        dec.feed(b"\xff" * n)
        assert dec.next() is None


def test_errors_are_kera_errors():
    assert issubclass(ProtocolError, KeraError)
    assert FrameTooLarge("x").to_wire()["code"] == "frame_too_large"
    assert frame.Frame(REQUEST, 1, {}, memoryview(b"")).kind == REQUEST
