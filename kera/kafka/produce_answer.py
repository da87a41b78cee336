"""A Produce response, written from a layout kio made once per request shape.

kio's writers build a dataclass per partition and write field by field: ~35 µs for a
one-partition answer, more than the append it answers (librdkafka sends one partition per
Produce request). The bytes of a Produce response depend on its version, its topics and
partitions, and per partition on four fixed-size fields (error code, base offset, log start
offset; the log append time is always -1 here) and an optional error message. So each shape
is written once by kio's writer, with marker values, and where each fixed field lies is
found in its bytes; an answer is then a copy of those bytes with the correlation id and the
fields packed in (~2 µs). An answer carrying an error message is written by kio.
"""

from __future__ import annotations

import struct

from kio.schema.errors import ErrorCode

from . import framing, versions

PRODUCE = 0
MAX_LAYOUTS = 8192            # request shapes kept (a client's are its partitions)
_CID = 0x7E57C1D0             # correlation id written in a layout (found at offset 4)
_MARK = 0x7E57_0000_0000_0000  # the k-th base offset written is _MARK + 2k, its log start + 1
_BASE = struct.Struct(">hq")  # error code, then base offset: their order in every version
_Q = struct.Struct(">q")
_I = struct.Struct(">i")
_layouts: dict[tuple, Layout] = {}


class Layout:
    """The response bytes of one shape: (version, ((topic, (partition, ...)), ...))."""

    __slots__ = ("bytes", "bases", "starts")

    def __init__(self, version: int, shape: tuple):
        frame = _render(version, shape, ErrorCode.none)
        n = sum(len(idx) for _, idx in shape)
        self.bytes = frame
        self.bases = [frame.index(_Q.pack(_MARK + 2 * k)) - 2 for k in range(n)]
        self.starts = [frame.index(_Q.pack(_MARK + 2 * k + 1)) for k in range(n)] \
            if version >= 5 else None
        if _I.unpack_from(frame, 4)[0] != _CID:
            raise AssertionError("a Produce response's correlation id is not at offset 4")
        other = _render(version, shape, ErrorCode.not_leader_or_follower)
        for at in self.bases:   # the error code sits just before the base offset
            if _BASE.unpack_from(other, at)[0] != ErrorCode.not_leader_or_follower:
                raise AssertionError("a Produce response's error code does not precede its base offset")


def _render(version: int, shape: tuple, code: ErrorCode) -> bytes:
    k, topics = 0, []
    for name, indexes in shape:
        parts = []
        for i in indexes:
            parts.append({"index": i, "error_code": code, "base_offset": _MARK + 2 * k,
                          "log_append_time": -1, "log_start_offset": _MARK + 2 * k + 1})
            k += 1
        topics.append({"name": name, "partition_responses": parts})
    cls = versions.response_class(PRODUCE, version)
    body = versions.make(cls, responses=topics, throttle_time=0)
    return b"".join(bytes(p) for p in framing.response(
        _CID, body, versions.writer(cls), versions.flexible_response_header(PRODUCE, version)))


def layout(version: int, shape: tuple) -> Layout:
    lay = _layouts.get((version, shape))
    if lay is None:
        if len(_layouts) >= MAX_LAYOUTS:
            _layouts.clear()
        lay = _layouts[(version, shape)] = Layout(version, shape)
    return lay


class ProduceAnswer(framing.Encoded):
    """The partitions' outcomes of one Produce request, in its order: per topic, rows of
    [partition, error code, base offset, log start offset, error message or None]."""

    __slots__ = ("version", "topics")

    def __init__(self, version: int):
        self.version = version
        self.topics: list[tuple[str, list]] = []

    def topic(self, name: str) -> list:
        rows: list = []
        self.topics.append((name, rows))
        return rows

    def timed_out(self) -> ProduceAnswer:
        return self.failed(ErrorCode.request_timed_out)

    def failed(self, code: ErrorCode) -> ProduceAnswer:
        """The partitions appended are told ``code`` (retriable: a resend is a duplicate)."""
        for _, rows in self.topics:
            for r in rows:
                if r[1] == ErrorCode.none:
                    r[1], r[2] = code, -1
        return self

    def frame(self, correlation_id: int) -> list:
        if any(r[4] is not None for _, rows in self.topics for r in rows):
            return self._written(correlation_id)
        lay = layout(self.version, tuple((name, tuple(r[0] for r in rows))
                                         for name, rows in self.topics))
        out = bytearray(lay.bytes)
        _I.pack_into(out, 4, correlation_id)
        k = 0
        starts = lay.starts
        for _, rows in self.topics:
            for r in rows:
                _BASE.pack_into(out, lay.bases[k], r[1], r[2])
                if starts is not None:
                    _Q.pack_into(out, starts[k], r[3])
                k += 1
        return [bytes(out)]

    def _written(self, correlation_id: int) -> list:
        """The answer written by kio (error messages: their lengths change the layout)."""
        cls = versions.response_class(PRODUCE, self.version)
        topics = [{"name": name, "partition_responses": [
            {"index": i, "error_code": ErrorCode(code), "base_offset": base, "log_append_time": -1,
             "log_start_offset": start, "error_message": msg} for i, code, base, start, msg in rows]}
            for name, rows in self.topics]
        body = versions.make(cls, responses=topics, throttle_time=0)
        return framing.response(correlation_id, body, versions.writer(cls),
                                versions.flexible_response_header(PRODUCE, self.version))
