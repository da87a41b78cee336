"""The sans-IO parts of kera.kafka: framing, versions, record batches, offsets, conversion."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kio.records.readers import read_batch
from kio.schema.errors import ErrorCode

from kera import chunk, errors
from kera.chunk import kafka_batch as batch
from kera.chunk import kafka_records
from kera.kafka import codes, convert, framing, versions
from kera.kafka.log import OffsetLog


def _chunk(values, keys=None, ts=1000, base=0):
    c = bytearray(chunk.build(1, 0, 5, 0, values, keys, ts))
    chunk.set_kafka_offset(c, 0, base)
    chunk.place(c, 0, 0, 0, 0)
    return bytes(c)


def test_frames_are_cut_at_their_size_and_bounded():
    d = framing.FrameDecoder(max_frame=100)
    body = struct.pack(">hhih", 18, 3, 7, -1)
    d.feed(struct.pack(">i", len(body)) + body[:4])
    assert d.next() is None
    d.feed(body[4:] + struct.pack(">i", 10**6))
    assert d.next() == body
    with pytest.raises(errors.ProtocolError):
        d.next()   # a frame over max_frame: the connection is dropped
    d2 = framing.FrameDecoder()
    d2.feed(struct.pack(">i", -5))
    with pytest.raises(errors.ProtocolError):
        d2.next()


def test_request_header_and_api_versions_answer():
    frame = struct.pack(">hhih", 18, 3, 42, 4) + b"kcat" + b"\x00" + b"\x00" * 3
    h = framing.read_header(frame, versions.flexible(18, 3))
    assert (h.api_key, h.version, h.correlation_id, h.client_id) == (18, 3, 42, "kcat")
    body = versions.api_versions_body(3)
    parts = framing.response(42, body, versions.writer(type(body)), versions.flexible_response_header(18, 3))
    out = b"".join(bytes(p) for p in parts)
    assert struct.unpack_from(">ii", out) == (len(out) - 4, 42)
    resp, _ = versions.reader(type(body))(out, 8)   # ApiVersions answers with header v0
    served = {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys}
    assert served[0] == (3, 9) and served[1] == (4, 12) and 21 not in served


def test_every_served_version_has_codecs_and_make_fills_missing_fields():
    for key, (_, lo, hi) in versions.SUPPORTED.items():
        for v in range(lo, hi + 1):
            cls = versions.response_class(key, v)
            versions.make(cls)   # every field gets its zero value
    assert not versions.supported(21, 0) and not versions.supported(0, 2) and versions.supported(0, 3)


def test_records_are_written_as_their_buffers():
    parts = [memoryview(b"x" * 1000), b"y" * 10]
    out = framing.Parts()
    out.write(b"\x00\x01")
    out.write(framing.Records(parts))
    got = out.done()
    assert got[1] is parts[0] and out.size == 1012


def test_batch_header_crc_and_base_offset():
    b = convert.to_batch(chunk.ChunkView(_chunk([b"a", b"bb", b"ccc"])), 0)
    h = batch.read(b)
    assert (h.count, h.last_offset_delta, h.producer_id, h.codec) == (3, 2, -1, 0)
    buf = bytearray(b)
    batch.set_base_offset(buf, 0, 1234)
    assert batch.read(buf).base_offset == 1234   # the CRC does not cover it
    buf[-1] ^= 1
    with pytest.raises(batch.CorruptRecord):
        batch.read(buf)
    with pytest.raises(batch.CorruptRecord):
        batch.read_all(b[:40])
    bad = bytearray(b)
    bad[16] = 1   # magic 1
    with pytest.raises(batch.CorruptRecord):
        batch.read(bad)


def test_error_codes_map_kera_errors():
    assert codes.of(errors.NotOwner()) == ErrorCode.not_leader_or_follower
    assert codes.of(errors.OutOfRange()) == ErrorCode.offset_out_of_range
    assert codes.of(errors.Recovering()) == ErrorCode.leader_not_available
    assert codes.of(ValueError()) == ErrorCode.unknown_server_error
    assert codes.of_code(None) == ErrorCode.none


class _Seg:
    def __init__(self, durable):
        self.durable = durable


def test_offset_log_assigns_dense_offsets_and_tracks_the_durable_head():
    log = OffsetLog()
    segs = {(0, 0): _Seg(0)}
    assert [log.append(n, 0, 0, 100 * i, 100) for i, n in enumerate((3, 1, 5))] == [0, 3, 4]
    held = lambda g, s: segs.get((g, s))   # noqa: E731
    assert log.high_watermark(held) == 0
    segs[(0, 0)].durable = 200
    assert log.high_watermark(held) == 4
    segs[(0, 0)].durable = 300
    assert log.high_watermark(held) == 9 and log.next == 9
    assert [log.find(x) for x in (0, 2, 3, 4, 8, 9)] == [0, 0, 1, 2, 2, 3]
    del segs[(0, 0)]
    assert log.log_start(held) == 9


def test_a_replay_out_of_order_is_sorted_and_old_chunks_numbered_after():
    log = OffsetLog()
    log.replayed(10, 5, 1, 0, 0, 64)
    log.replayed(0, 10, 0, 0, 0, 64)
    log.replayed(None, 2, 2, 0, 0, 64)
    log.finish()
    assert [log.base(i) for i in range(len(log))] == [0, 10, 15] and log.next == 17


def test_duplicates_are_answered_with_their_offset():
    log = OffsetLog()
    log.remember(7, 5, 100)
    assert log.duplicate_base(7, 5) == 100 and log.duplicate_base(7, 6) == -1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=300), st.binary(max_size=40)), min_size=1, max_size=300),
       st.integers(0, 1 << 40))
def test_kera_chunks_round_trip_through_record_batches(records, t0):
    values = [v for v, _ in records]
    keys = [k or None for _, k in records]
    ts = [t0 + (i * 7919) % 1000 for i in range(len(records))]
    c = _chunk(values, keys, ts, base=99)
    b = convert.to_batch(chunk.ChunkView(c), 99)
    kio_batch, _ = read_batch(b, 0)
    assert [r.value for r in kio_batch.records] == values
    assert [r.key for r in kio_batch.records] == keys
    assert [r.offset for r in kio_batch.records] == list(range(99, 99 + len(values)))
    wrapped = convert.wrap(b, 0, batch.read(b), 1, 0, 7, 3, 99)
    v = chunk.ChunkView(wrapped)
    assert v.values() == values and v.keys() == keys and v.timestamps.tolist() == ts
    assert chunk.kafka_offset(wrapped) == 99


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_compressed_batches_decode(codec):
    import zlib

    import cramjam
    plain = convert.to_batch(chunk.ChunkView(_chunk([b"v%d" % i * 20 for i in range(500)])), 0)
    records = plain[batch.HEADER_SIZE:]
    packed = {0: lambda r: r, 1: lambda r: zlib.compress(r, wbits=16 + zlib.MAX_WBITS),
              2: lambda r: bytes(cramjam.snappy.compress_raw(r)),
              3: lambda r: bytes(cramjam.lz4.compress(r)), 4: lambda r: bytes(cramjam.zstd.compress(r))}[codec](records)
    head = bytearray(plain[:batch.HEADER_SIZE])
    struct.pack_into(">h", head, 21, codec)
    b = bytearray(head + packed)
    struct.pack_into(">i", b, 8, len(b) - batch.LOG_OVERHEAD)
    batch.seal(b)
    ts, ko, kb, vo, vb = kafka_records.records_of(bytes(b))
    assert len(ts) == 500 and vb == b"".join(b"v%d" % i * 20 for i in range(500))


def test_broken_records_are_refused_not_read_past_the_batch():
    b = bytearray(convert.to_batch(chunk.ChunkView(_chunk([b"abc", b"de"])), 0))
    b[batch.HEADER_SIZE] = 0x7E   # the first record's length: far past the batch
    batch.seal(b)
    with pytest.raises(batch.CorruptRecord):
        kafka_records.records_of(bytes(b))


def test_compacted_chunks_keep_their_offsets_as_deltas():
    v = chunk.ChunkView(_chunk([b"a", b"b", b"c", b"d"]))
    c = chunk.rewrite(v, np.array([1, 3]))
    assert chunk.kafka_offset(c) == 0
    cv = chunk.ChunkView(c)
    b = convert.to_batch(cv, 10, chunk.original_indices(cv))
    kb, _ = read_batch(b, 0)
    assert [(r.offset, r.value) for r in kb.records] == [(11, b"b"), (13, b"d")]


def test_the_spark_source_reads_a_kafka_producers_chunk():
    from kera_client.spark.arrow import ChunkBatch
    b = convert.to_batch(chunk.ChunkView(_chunk([b"a", b"bb"], [b"k", None], [5, 6])), 0)
    cb = ChunkBatch()
    cb.add("s", 0, 0, 0, convert.wrap(b, 0, batch.read(b), 1, 0, 7, 3, 0))
    rows = cb.build().to_pylist()
    assert [(r["key"], r["value"], r["producer"]) for r in rows] == [(b"k", b"a", 7), (None, b"bb", 7)]
