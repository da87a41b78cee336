"""A producer's sequences on a streamlet: what makes its retries idempotent (a sequence
already appended is acknowledged again once durable, never stored twice)."""

from __future__ import annotations

from ..errors import OutOfOrderSequence, UnknownProducer


class ProducerState:
    """A producer's newest sequence here, and per vlog its chunks went to, its newest ref.

    Groups change vlogs, so a duplicate's chunk may sit in another vlog than
    the producer's newest one: it is durable once every vlog listed is
    durable up to its ref (conservative, and the list is short: vlogs whose
    refs are all durable are forgotten when the producer moves to a new one).
    Each ref comes with its chunk's segment and end, which say it is durable.
    The refs are one flat list, [vlog, ref, segment or None, end, ...]: most
    producers use one vlog of a streamlet at a time, and a list of four costs a
    third of a dict of tuples.
    """

    __slots__ = ("producer", "last_seq", "refs")

    def __init__(self, producer: int, last_seq: int, refs: list):
        self.producer = producer
        self.last_seq = last_seq
        self.refs = refs  # [vlog, ref, segment or None, end of the chunk in it, ...]

    def waits(self):
        """(vlog, ref) pairs that must be durable before a duplicate is acknowledged."""
        r = self.refs
        return [(r[i], r[i + 1]) for i in range(0, len(r), 4)
                if r[i + 2] is None or r[i + 2].durable < r[i + 3]]

    def note(self, vlog, ref: int, segment, end: int) -> None:
        """The producer's chunk ``ref`` in ``vlog``: kept if it is that vlog's newest."""
        r = self.refs
        for i in range(0, len(r), 4):
            if r[i] == vlog:
                if ref > r[i + 1]:
                    r[i + 1:i + 4] = ref, segment, end
                return
        # a new group's vlog (rare): forget the vlogs already durable
        keep = []
        for i in range(0, len(r), 4):
            seg = r[i + 2]
            if seg is None or seg.durable < r[i + 3]:
                keep += r[i:i + 4]
        self.refs = [*keep, vlog, ref, segment, end]


def verdict(st: ProducerState | None, producer: int, seq: int, reset: int, stream_id: int,
            streamlet: int) -> ProducerState | None:
    """A chunk of ``producer`` with sequence ``seq`` on a streamlet where its state is ``st``:
    the state if it is a duplicate (already appended), None if it is to be appended.

    ``reset`` (the chunk's SEQ_RESET flag): a sequence past the next one is the producer's
    new base, not a hole; older ones are duplicates all the same, so a late copy of a chunk
    the producer gave up on is never stored. A producer's first chunk here starts at 0 or is
    a reset (``UnknownProducer`` otherwise): never a base taken on trust, which would make
    the producer's own chunks below it duplicates, acknowledged and never stored.
    """
    if st is None:
        if seq == 0 or reset:
            return None
        raise UnknownProducer(f"producer {producer} is not known on stream {stream_id} "
                              f"streamlet {streamlet}: its first chunk here is sequence 0 or "
                              f"a reset, not {seq}")
    if seq == st.last_seq + 1:
        return None
    if seq <= st.last_seq:
        return st
    if reset:
        return None
    raise OutOfOrderSequence(f"producer {producer} sent sequence {seq} after {st.last_seq} on "
                             f"stream {stream_id} streamlet {streamlet}")
