"""Kafka's framing, sans-IO: size-prefixed requests in, size-prefixed responses out.

A request is ``int32 size`` then its header (api key, version, correlation id, client id;
tagged fields from header v2) and body; headers and bodies are read and written by kio's
codecs, generated from Kafka's JSON schemas (``kera.kafka.versions`` says which). A size
below a header's or above ``max_frame`` is a ``ProtocolError``: the connection is dropped,
as a Kafka broker drops it (its ``socket.request.max.bytes``).

Responses are gathered as a list of buffers (``Parts``): a Fetch's record batches go out
as the memoryviews of the segments holding them, never joined into one copy (``Records``).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kio.schema.request_header.v1.header import RequestHeader as RequestHeaderV1
from kio.schema.request_header.v2.header import RequestHeader as RequestHeaderV2
from kio.schema.response_header.v0.header import ResponseHeader as ResponseHeaderV0
from kio.schema.response_header.v1.header import ResponseHeader as ResponseHeaderV1
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import i32

from ..errors import ProtocolError
from ..limits import MAX_FRAME

_SIZE = struct.Struct(">i")
_PEEK = struct.Struct(">hhi")    # api key, version, correlation id: how any header begins
MIN_REQUEST = 8 + 2              # the fixed fields and a null client id
SMALL = 512                      # pieces up to this size are joined before they go out

_read_v1 = entity_reader(RequestHeaderV1)
_read_v2 = entity_reader(RequestHeaderV2)
_write_v0 = entity_writer(ResponseHeaderV0)
_write_v1 = entity_writer(ResponseHeaderV1)


class FrameDecoder:
    """Bytes in, whole request frames out (``next``), each at most ``max_frame`` bytes. Frames
    are cut at a read position; the buffer is compacted once per ``feed``, not per frame."""

    __slots__ = ("buf", "at", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME):
        self.buf = bytearray()
        self.at = 0
        self.max_frame = max_frame

    def feed(self, data) -> None:
        if self.at:
            del self.buf[:self.at]
            self.at = 0
        self.buf += data

    @property
    def pending(self) -> int:
        return len(self.buf) - self.at

    def next(self) -> bytes | None:
        buf, at = self.buf, self.at
        if len(buf) - at < 4:
            return None
        size = _SIZE.unpack_from(buf, at)[0]
        if size < MIN_REQUEST or size > self.max_frame:
            raise ProtocolError(f"a Kafka request of {size} bytes (at least {MIN_REQUEST}, at most "
                                f"{self.max_frame})")
        end = at + 4 + size
        if len(buf) < end:
            return None
        with memoryview(buf) as mv:
            out = bytes(mv[at + 4:end])
        self.at = end
        return out


class Header(NamedTuple):
    api_key: int
    version: int
    correlation_id: int
    client_id: str | None
    body: int            # where the body starts in the frame


def peek(frame) -> tuple[int, int, int]:
    """(api key, version, correlation id): enough to answer a request whose header or body
    cannot be read (an unknown API, a version out of range)."""
    return _PEEK.unpack_from(frame)


def read_header(frame, flexible: bool) -> Header:
    """The request header (v2 for a flexible request version, else v1)."""
    try:
        h, n = (_read_v2 if flexible else _read_v1)(frame, 0)
    except Exception as e:  # noqa: BLE001 (kio raises several types for short or bad input)
        raise ProtocolError(f"unreadable Kafka request header: {e}") from None
    return Header(h.request_api_key, h.request_api_version, h.correlation_id, h.client_id, n)


class Records:
    """A records field given as buffers (segment slices), written without joining them."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list):
        self.parts = parts
        self.size = sum(memoryview(p).nbytes for p in parts)

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other) -> bool:   # kio compares tagged fields with their defaults
        return other is self


class Encoded:
    """An answer already encoded but for its correlation id: ``frame(cid)`` gives its frame."""

    __slots__ = ()

    def frame(self, correlation_id: int) -> list:
        raise NotImplementedError


class Parts:
    """A kio ``Writable`` that keeps what is written as a list of buffers: small pieces are
    joined as they come, ``Records`` are kept as their buffers."""

    __slots__ = ("parts", "small", "size")

    def __init__(self):
        self.parts: list = []
        self.small = bytearray()
        self.size = 0

    def write(self, b) -> int:
        if type(b) is Records:
            if self.small:
                self.parts.append(bytes(self.small))
                self.small.clear()
            self.parts.extend(b.parts)
            self.size += b.size
            return b.size
        n = len(b)
        if n <= SMALL:
            self.small += b
        else:
            if self.small:
                self.parts.append(bytes(self.small))
                self.small.clear()
            self.parts.append(b)
        self.size += n
        return n

    def done(self) -> list:
        if self.small:
            self.parts.append(bytes(self.small))
            self.small = bytearray()
        return self.parts


def response(correlation_id: int, body, write_body, flexible_header: bool) -> list:
    """The frame of a response: its size, header (v1 for a flexible response, v0 otherwise
    and always for ApiVersions) and body, as buffers."""
    out = Parts()
    out.write(b"\0\0\0\0")
    if flexible_header:
        _write_v1(out, ResponseHeaderV1(correlation_id=i32(correlation_id)))
    else:
        _write_v0(out, ResponseHeaderV0(correlation_id=i32(correlation_id)))
    write_body(out, body)
    parts = out.done()
    first = bytearray(parts[0]) if isinstance(parts[0], bytes) else bytearray(bytes(parts[0]))
    _SIZE.pack_into(first, 0, out.size - 4)
    parts[0] = bytes(first)
    return parts
