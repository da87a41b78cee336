"""Sans-IO frame codec: bytes in, frames out, and back.

A frame is a fixed 16-byte prefix (magic, version, kind, request id, meta
length, payload length), a msgpack map ("meta") and a raw payload. Lengths
are checked against ``kera.limits`` before any buffer is allocated, so a peer
that announces 4 GiB costs nothing; a frame over them is not even built. The
trio code only moves bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from .errors import FrameTooLarge, ProtocolError
from .limits import FRAME_PREFIX, MAX_FRAME, MAX_META

MAGIC = b"KF"
VERSION = 1
PREFIX = struct.Struct("<2sBBIII")
PREFIX_SIZE = PREFIX.size
assert PREFIX_SIZE == FRAME_PREFIX

REQUEST = 1
RESPONSE = 2
ERROR = 3
KINDS = (REQUEST, RESPONSE, ERROR)


@dataclass(slots=True)
class Frame:
    kind: int
    request_id: int
    meta: dict
    payload: memoryview


def nbytes(b) -> int:
    """Byte size of a buffer (len() counts items: wrong for numpy or array.array)."""
    t = type(b)
    if t is bytes or t is bytearray:
        return len(b)
    return b.nbytes if t is memoryview else memoryview(b).nbytes


def _check(mlen: int, plen: int) -> None:
    """Refuse to build what no peer would accept (``FrameDecoder``'s limits), before sending."""
    if mlen > MAX_META:
        raise FrameTooLarge(f"meta of {mlen} bytes exceeds MAX_META ({MAX_META})")
    if PREFIX_SIZE + mlen + plen > MAX_FRAME:
        raise FrameTooLarge(f"frame of {PREFIX_SIZE + mlen + plen} bytes exceeds MAX_FRAME ({MAX_FRAME})")


def encode(kind: int, request_id: int, meta: dict, payload=b"") -> bytes:
    """One contiguous frame: a single copy of the payload, a single send."""
    m = msgpack.packb(meta, use_bin_type=True)
    plen = nbytes(payload)
    _check(len(m), plen)
    return b"".join((PREFIX.pack(MAGIC, VERSION, kind, request_id, len(m), plen), m, payload))


def encode_parts(kind: int, request_id: int, meta: dict, parts) -> bytes:
    """A frame whose payload is the concatenation of ``parts`` (buffers)."""
    return b"".join(frame_buffers(kind, request_id, meta, parts))


def frame_buffers(kind: int, request_id: int, meta: dict, parts, plen: int | None = None) -> list:
    """The same frame as a list of buffers, ``parts`` uncopied, for a vectored send (``plen``:
    their byte size, when the caller counted it already)."""
    m = msgpack.packb(meta, use_bin_type=True)
    if plen is None:
        plen = sum(map(nbytes, parts))
    _check(len(m), plen)
    return [PREFIX.pack(MAGIC, VERSION, kind, request_id, len(m), plen) + m, *parts]


GATHER = 1 << 16  # a frame at least this large still arriving is gathered piece by piece


class FrameDecoder:
    """Incremental decoder. ``feed`` bytes, then ``next`` until it returns None.

    A frame's payload is copied once out of what was fed, after its prefix was
    validated, into bytes of its own, so payload memoryviews stay valid (and
    unchanging) after later feeds. What is fed as bytes is read where it lies (a
    receive of many frames is not first copied into a stream buffer); only a
    partial frame left at its end is kept in a buffer of the decoder's own. A large
    frame (``GATHER`` bytes or more) still arriving is kept as the pieces fed (views
    of them when they are bytes) and joined once complete: no growing stream buffer,
    and an announced size alone allocates nothing.
    """

    def __init__(self, max_frame: int = MAX_FRAME):
        self.max_frame = max_frame
        # what is not parsed yet: bytes fed (or a view of them), or a buffer of the decoder's own
        self._buf: bytes | memoryview | bytearray = b""
        self._pos = 0
        self._pieces: list | None = None  # a large frame being gathered
        self._need = 0                    # and the bytes it still lacks
        self.gathered = 0                 # and the bytes it holds

    def feed(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self._pieces is not None and self._need:  # the stream buffer is empty meanwhile
            take = min(len(mv), self._need)
            self._pieces.append(mv[:take] if type(data) is bytes else bytes(mv[:take]))
            self._need -= take
            self.gathered += take
            mv = mv[take:]
            if not mv:
                return
        if self._pos == len(self._buf):   # nothing left over: read the new bytes where they are
            self._buf = mv if type(data) is bytes else bytes(mv)
            self._pos = 0
            return
        if type(self._buf) is not bytearray:   # a partial frame left at the end of bytes fed
            with memoryview(self._buf) as m:
                self._buf = bytearray(m[self._pos:])
            self._pos = 0
        self._buf += mv

    @property
    def pending(self) -> int:
        return len(self._buf) - self._pos + self.gathered

    def _prefix(self, buf, pos: int) -> tuple[int, int, int, int]:
        """A frame prefix's (kind, request id, meta length, payload length), checked."""
        magic, version, kind, rid, mlen, plen = PREFIX.unpack_from(buf, pos)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
        if version != VERSION:
            raise ProtocolError(f"unsupported frame version {version}")
        if kind not in KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        if mlen > MAX_META:
            raise FrameTooLarge(f"meta of {mlen} bytes exceeds MAX_META ({MAX_META})")
        if PREFIX_SIZE + mlen + plen > self.max_frame:
            raise FrameTooLarge(f"frame of {PREFIX_SIZE + mlen + plen} bytes exceeds {self.max_frame}")
        return kind, rid, mlen, plen

    def next(self) -> Frame | None:
        if self._pieces is not None:
            if self._need:
                return None
            f = b"".join(self._pieces)
            self._pieces = None
            self.gathered = 0
            kind, rid, mlen, _ = self._prefix(f, 0)
            return Frame(kind, rid, _meta(f, PREFIX_SIZE, mlen), memoryview(f)[PREFIX_SIZE + mlen:])
        buf, pos = self._buf, self._pos
        if len(buf) - pos < PREFIX_SIZE:
            return None
        kind, rid, mlen, plen = self._prefix(buf, pos)
        size = PREFIX_SIZE + mlen + plen
        end = pos + size
        if len(buf) < end:
            if size >= GATHER:   # bytes fed are kept as a view: they never change
                with memoryview(buf) as m:
                    self._pieces = [bytes(m[pos:]) if type(buf) is bytearray else m[pos:]]
                self._need = end - len(buf)
                self.gathered = len(buf) - pos
                self._buf, self._pos = b"", 0
            return None
        mstart = pos + PREFIX_SIZE
        meta = _meta(buf, mstart, mlen)
        with memoryview(buf) as m:
            payload = memoryview(bytes(m[mstart + mlen:end]))
        self._pos = end
        if end == len(buf):
            self._buf, self._pos = b"", 0
        elif end > (1 << 20) and type(buf) is bytearray:
            del buf[:end]
            self._pos = 0
        return Frame(kind, rid, meta, payload)


def _meta(buf, start: int, mlen: int) -> dict:
    with memoryview(buf) as m:
        try:
            meta = msgpack.unpackb(m[start:start + mlen], raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable frame meta: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError("frame meta is not a map")
    return meta
