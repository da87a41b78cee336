"""Produce and InitProducerId: a Kafka producer's batches appended as kera chunks.

Each batch (``batch.read``: header and CRC checked, records never parsed) becomes one
chunk holding it as it arrived (``convert.wrap``), appended to its streamlet's active
group, placed, referenced in the group's virtual log and answered by acks: 0 (no answer),
1 (once appended), -1 (once on every copy, as kera's ``acks=all``). The partition's next
dense offsets go into the batch's base offset field and the chunk header.

Idempotence: a Kafka producer id is a kera producer id (from the coordinator's counter)
and a batch's sequences are kept in the streamlet's producer state as one kera sequence,
``epoch << 32 | last sequence of the batch``, which a recovery restores from the chunks
like any other. A batch continuing the producer's sequence is appended; a retried one is
a duplicate, answered with the offset it got (``OffsetLog.remember``) once durable; a
gap is ``OUT_OF_ORDER_SEQUENCE_NUMBER``; an older epoch ``INVALID_PRODUCER_EPOCH``; a new
epoch starts again at sequence 0. Transactions are not served.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from .. import chunk
from ..chunk import kafka_batch as batch
from ..errors import Fenced, KeraError
from ..names import is_internal
from ..rpc import Later
from ..vlog import when_all_durable
from . import codes, convert
from .answers import Waiting
from .produce_answer import ProduceAnswer

APPEND, DUPLICATE = 0, 1
SCAN = 4096                # newest chunks searched for a resent batch's offset after a recovery
NO_PRODUCER = 0            # the kera producer id of batches sent without one
_MAX_EPOCH = (1 << 15) - 1


def handlers(gw) -> dict:
    return {"produce": lambda c, r, v: _produce(gw, c, r, v),
            "init_producer_id": lambda c, r, v: _init_producer_id(gw, c, r, v)}


def check(sl, b: batch.Batch) -> tuple[int, int] | ErrorCode:
    """(APPEND or DUPLICATE, the kera sequence) for batch ``b`` on streamlet ``sl``, or the
    error code refusing it."""
    if b.producer_id < 0:
        return APPEND, 0
    if b.attributes & (batch.TRANSACTIONAL | batch.CONTROL):
        return ErrorCode.invalid_txn_state
    epoch, last = b.producer_epoch, b.last_sequence
    seq = epoch << 32 | last
    st = sl.producer(b.producer_id)
    if st is None:
        return (APPEND, seq) if b.base_sequence == 0 else ErrorCode.unknown_producer_id
    had_epoch, had = st.last_seq >> 32, st.last_seq & 0xFFFFFFFF
    if epoch > had_epoch:
        return (APPEND, seq) if b.base_sequence == 0 else ErrorCode.out_of_order_sequence_number
    if epoch < had_epoch:
        return ErrorCode.invalid_producer_epoch
    if b.base_sequence == (had + 1) % (1 << 31):
        return APPEND, seq
    if b.base_sequence <= had and last <= had:
        return DUPLICATE, seq
    return ErrorCode.out_of_order_sequence_number


def _held(sl):
    def held(gid, si):
        g = sl.groups.get(gid)
        return g.segments[si] if g is not None and si >= g.start else None
    return held


def append(broker, stream, sl, data, b: batch.Batch, waits: dict) -> int:
    """Append the batch ``b`` of ``data`` to ``sl`` (checked): its base offset; the vlog it
    waits on goes into ``waits``."""
    log = sl.kafka_log()
    base = log.next
    kseq = b.producer_epoch << 32 | b.last_sequence if b.producer_id >= 0 else 0
    producer = b.producer_id if b.producer_id >= 0 else NO_PRODUCER
    c, digest = convert.wrapped(data, b.start, b, stream.id, sl.index, producer, kseq, base)
    g, seg, soff = sl.append(c, producer)
    chunk.place(seg.buf, soff, g.id, seg.id, soff, base)
    vlog = g.vlog or broker.vlog_for(stream, sl.index, g)
    idx = waits[vlog] = vlog.append(seg, soff, len(c), digest)
    sl.note_producer(producer, kseq, vlog, idx, seg, soff + len(c))
    sl.plain_last = sl.appended_chunks
    if b.producer_id >= 0:
        log.remember(b.producer_id, kseq, base)
    if broker.sessions:
        broker._touch_when_durable({vlog: [(stream.id, sl.index)]}, {vlog: idx})
    broker.records_in += b.count
    broker.bytes_in += len(c)
    return base


def duplicate_base(sl, producer: int, kseq: int) -> int:
    """The base offset a resent batch was given: remembered, or (after a recovery) found by
    its header among the streamlet's newest chunks held in memory; -1 if not found."""
    log = sl.kafka_log()
    base = log.duplicate_base(producer, kseq)
    held = _held(sl)
    for i in range(len(log) - 1, max(len(log) - SCAN, 0) - 1, -1):
        if base >= 0:
            break
        gid, si, off = log.place(i)
        seg = held(gid, si)
        if seg is not None and seg.buf is not None and seg.compacted is None:
            f = chunk.HEADER.unpack_from(seg.buf, off)
            if f[6] == producer and f[7] == kseq:
                base = log.base(i)
    return base


def _partition(broker, conn, topic: str, p, waits: dict, counts: dict) -> list:
    """One partition's batches appended: its answer's row [partition, error code, base
    offset, log start offset, error message]."""
    sid = broker.names.get(topic)
    if is_internal(topic):
        return [p.index, ErrorCode.invalid_topic_exception, -1, -1, None]
    if not conn.peer.may("write", "stream", topic):
        return [p.index, ErrorCode.topic_authorization_failed, -1, -1, None]
    sl = broker.streamlets.get((sid, p.index)) if sid is not None else None
    if sl is None or sl.recovering:
        return [p.index, ErrorCode.not_leader_or_follower if sl is None
                else ErrorCode.leader_not_available, -1, -1, None]
    try:
        batches = batch.read_all(p.records or b"")
    except KeraError as e:
        return [p.index, ErrorCode.corrupt_message, -1, -1, str(e)]
    stream = broker.streams[sid]
    counts["produce_batches"] += len(batches)
    first = None
    for b in batches:
        verdict = check(sl, b)
        if isinstance(verdict, ErrorCode):
            return [p.index, verdict, -1, -1, None]
        try:
            if verdict[0] == DUPLICATE:
                st = sl.producer(b.producer_id)
                for v, ref in st.waits():
                    waits[v] = max(waits.get(v, 0), ref)
                base = duplicate_base(sl, b.producer_id, verdict[1])
            else:
                base = append(broker, stream, sl, p.records, b, waits)
        except KeraError as e:
            return [p.index, codes.of(e), -1, -1, str(e)]
        first = base if first is None else first
    return [p.index, ErrorCode.none, first, sl.kafka_log().log_start(_held(sl)), None]


def _produce(gw, conn, req, version):
    """Every partition's batches appended in request order; the answer at once (acks 1),
    none (acks 0), or once every chunk is durable (acks -1: ``Waiting``, settled by the
    virtual logs' durability callbacks, no task per request)."""
    broker = gw.broker
    if req.transactional_id is not None:
        return _all(req, version, ErrorCode.transactional_id_authorization_failed)
    if broker.fenced:
        return _all(req, version, ErrorCode.not_leader_or_follower)
    try:
        broker._check_lease()
    except Fenced:
        return _all(req, version, ErrorCode.not_leader_or_follower)
    broker.requests += 1
    counts = gw.counts
    counts["produce_requests"] += 1
    waits: dict = {}
    answer = ProduceAnswer(version)
    for t in req.topic_data:
        rows = answer.topic(t.name)
        for p in t.partition_data:
            rows.append(_partition(broker, conn, t.name, p, waits, counts))
    if req.acks == 0:
        return None
    if req.acks == 1 or not waits:
        return answer
    later = Later()
    when_all_durable(waits, lambda: later.done(answer),
                     lambda error: later.done(answer.failed(codes.of(error))))
    return Waiting(later, max(req.timeout.total_seconds(), 1.0), answer.timed_out)


def _all(req, version: int, code: ErrorCode) -> ProduceAnswer:
    answer = ProduceAnswer(version)
    for t in req.topic_data:
        answer.topic(t.name).extend([p.index, code, -1, -1, None] for p in t.partition_data)
    return answer


async def _init_producer_id(gw, conn, req, version):
    """A new producer id (epoch 0), or the epoch after the one given (KIP-360's bump)."""
    if req.transactional_id is not None:
        return {"throttle_time": 0, "error_code": ErrorCode.transactional_id_authorization_failed,
                "producer_id": -1, "producer_epoch": -1}
    pid, epoch = getattr(req, "producer_id", -1), getattr(req, "producer_epoch", -1)
    if pid >= 0 and 0 <= epoch < _MAX_EPOCH:
        return {"throttle_time": 0, "error_code": ErrorCode.none, "producer_id": pid,
                "producer_epoch": epoch + 1}
    try:
        r = await gw.coordinator("producer_id", {})
    except KeraError as e:
        return {"throttle_time": 0, "error_code": codes.of(e), "producer_id": -1, "producer_epoch": -1}
    return {"throttle_time": 0, "error_code": ErrorCode.none, "producer_id": r["id"],
            "producer_epoch": 0}
