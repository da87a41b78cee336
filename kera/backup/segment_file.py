"""Replica segment files: what a backup keeps on disk for one virtual segment.

Layout (little endian)::

    file header   64 bytes  FILE_HEADER: magic "KSEG", version, header size,
                            broker, vlog, vseg, broker epoch, creation time (ms),
                            xxh32 of the 60 bytes before it
    chunk area    chunks exactly as they came on the wire, back to back
    trailer       88 bytes, only once the broker closed the segment:
                  magic "KEND", area length, chunk count, close time (ms),
                  xxh32 of the 84 bytes before it

The *closed* marker is the trailer, written (and fsynced with) the last bytes
of the chunk area, so one file says everything and a file is never written
after its trailer. The trailer is exactly as long as a chunk header: shorter
than that at the end of a file is a torn write (cut), and a damaged trailer
is caught like a damaged chunk header (reported).

Reading a file back (``scan_area`` / ``load``) verifies every chunk with
``kera.chunk.verify``; one call per chunk, never per record:

- *torn tail*: the file ends inside a chunk header (or trailer), inside a
  chunk body, or in zeros (an extent allocated but never written): cut back to
  the end of the last complete chunk. A torn write was never acknowledged
  with ``--fsync always``, so cutting it loses nothing the broker counts on.
- *corrupt chunk*: header valid, body checksum wrong: reported, skipped, never
  served; the next chunk is found through the header's length.
- *damaged header*: the next chunk cannot be located, so everything from there
  to the end (to the trailer, if a valid one ends the file) is reported
  corrupt. It is kept on disk (someone may want to look at it) and not
  truncated: it is not a torn tail.

Offsets everywhere are in the chunk area (offset 0 = first chunk byte), the
same offsets the broker uses in ``replicate``.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import time
from array import array
from dataclasses import dataclass, field

import numpy as np
import xxhash

from .. import iov
from ..chunk import HEADER_SIZE, parse_header
from ..errors import BackupError, ChecksumError, ProtocolError
from ..metafile import fsync_path

FILE_MAGIC = b"KSEG"
FILE_VERSION = 1
FILE_HEADER = struct.Struct("<4sHHQQQQq12xI")
FILE_HEADER_SIZE = FILE_HEADER.size
assert FILE_HEADER_SIZE == 64

TRAILER_MAGIC = b"KEND"
TRAILER = struct.Struct("<4s4xQQq52xI")
TRAILER_SIZE = TRAILER.size
assert TRAILER_SIZE == HEADER_SIZE == 88

SUFFIX = ".seg"
_NAME = re.compile(r"^(\d+)-(\d+)-(\d+)\.seg$")


@dataclass(slots=True, frozen=True)
class FileHeader:
    broker: int
    vlog: int
    vseg: int
    epoch: int
    created_ms: int


@dataclass(slots=True)
class Scan:
    """What a chunk area holds: good chunks, corrupt regions, where it ends."""

    length: int                 # bytes of chunk area kept (good + corrupt), trailer excluded
    starts: array               # start offsets of good chunks ('Q')
    ends: array                 # end offsets of good chunks ('Q')
    corrupt: list = field(default_factory=list)  # [{"offset", "length", "reason"}], sorted
    closed: bool = False        # a valid trailer ends the area
    cut: int | None = None      # torn tail: the area on disk must be cut back to this size
    damaged: bool = False       # a corrupt region of unknown extent runs to the end
    digest: object = None       # xxh3 over the body checksums of chunks with valid headers

    @property
    def chunks(self) -> int:
        return len(self.starts)


@dataclass(slots=True)
class Loaded:
    """A segment file after ``load``: its header (None if damaged) and its scan."""

    path: str
    header: FileHeader | None
    scan: Scan | None
    file_size: int              # after repair
    cut_bytes: int = 0          # bytes removed from a torn tail
    error: str | None = None    # why the file cannot be used (damaged file header)

    # what is good, at a glance (0 / empty when the file header is unusable)
    @property
    def length(self) -> int:
        return self.scan.length if self.scan else 0

    @property
    def chunks(self) -> int:
        return self.scan.chunks if self.scan else 0

    @property
    def corrupt(self) -> list:
        return self.scan.corrupt if self.scan else []

    @property
    def closed(self) -> bool:
        return bool(self.scan and self.scan.closed)


def file_name(broker: int, vlog: int, vseg: int) -> str:
    return f"{broker}-{vlog}-{vseg}{SUFFIX}"


def parse_name(name: str) -> tuple[int, int, int] | None:
    m = _NAME.match(name)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def encode_header(broker: int, vlog: int, vseg: int, epoch: int, created_ms: int | None = None) -> bytes:
    if created_ms is None:
        created_ms = int(time.time() * 1000)
    head = bytearray(FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, FILE_HEADER_SIZE, broker, vlog, vseg,
                                      epoch, created_ms, 0))
    struct.pack_into("<I", head, FILE_HEADER_SIZE - 4, xxhash.xxh32_intdigest(bytes(head[:-4])))
    return bytes(head)


def decode_header(buf) -> FileHeader:
    if len(buf) < FILE_HEADER_SIZE:
        raise BackupError("segment file shorter than its header")
    magic, version, size, broker, vlog, vseg, epoch, created, check = FILE_HEADER.unpack_from(buf, 0)
    if magic != FILE_MAGIC or version != FILE_VERSION or size != FILE_HEADER_SIZE:
        raise BackupError("not a kera segment file (magic/version)")
    if xxhash.xxh32_intdigest(memoryview(buf)[:FILE_HEADER_SIZE - 4]) != check:
        raise ChecksumError("segment file header checksum mismatch")
    return FileHeader(broker, vlog, vseg, epoch, created)


def encode_trailer(length: int, chunks: int, closed_ms: int | None = None) -> bytes:
    if closed_ms is None:
        closed_ms = int(time.time() * 1000)
    t = bytearray(TRAILER.pack(TRAILER_MAGIC, length, chunks, closed_ms, 0))
    struct.pack_into("<I", t, TRAILER_SIZE - 4, xxhash.xxh32_intdigest(bytes(t[:-4])))
    return bytes(t)


def _trailer_ok(area, pos: int) -> bool:
    magic, length, _chunks, _ms, check = TRAILER.unpack_from(area, pos)
    return (magic == TRAILER_MAGIC and length == pos
            and xxhash.xxh32_intdigest(area[pos:pos + TRAILER_SIZE - 4]) == check)


def scan_area(area) -> Scan:
    """Verify every chunk of a chunk area (sans-IO). See the module docstring."""
    area = memoryview(area).cast("B")
    n = area.nbytes
    starts, ends = array("Q"), array("Q")
    out = Scan(0, starts, ends)
    digest = xxhash.xxh3_64()
    pos = 0
    while pos < n:
        rem = n - pos
        if rem < HEADER_SIZE:  # a torn chunk header or torn trailer (same size)
            out.cut = pos
            break
        if area[pos:pos + 4] == TRAILER_MAGIC:
            if _trailer_ok(area, pos):
                out.closed = True
                if rem > TRAILER_SIZE:
                    out.cut = pos + TRAILER_SIZE  # nothing is ever written after a trailer
                break
            out.corrupt.append({"offset": pos, "length": rem, "reason": "damaged trailer"})
            out.damaged = True
            pos = n
            break
        try:
            h = parse_header(area, pos)
        except (ProtocolError, ChecksumError) as e:
            if _zeros(area[pos:]):
                out.cut = pos
                break
            # a valid trailer at the very end still says where the area ends (it names
            # its own position): the damage stops there and the segment is closed
            end = n - TRAILER_SIZE
            if end > pos and _trailer_ok(area, end):
                out.closed = True
            else:
                end = n
            out.corrupt.append({"offset": pos, "length": end - pos, "reason": f"damaged chunk header: {e}"})
            out.damaged = True
            pos = end
            break
        end = pos + h.size
        if end > n:
            out.cut = pos
            break
        digest.update(h.body_checksum.to_bytes(8, "little"))
        if xxhash.xxh3_64_intdigest(area[pos + HEADER_SIZE:end]) != h.body_checksum:
            out.corrupt.append({"offset": pos, "length": h.size, "reason": "chunk body checksum mismatch"})
        else:
            starts.append(pos)
            ends.append(end)
        pos = end
    out.length = pos
    out.digest = digest
    return out


def _zeros(view) -> bool:
    """True if ``view`` holds only zero bytes (an allocated but unwritten extent)."""
    a = np.frombuffer(view, dtype=np.uint8)
    return a.size > 0 and not a.any()


def load(path: str, repair: bool = True) -> Loaded:
    """Read and verify a segment file; with ``repair`` cut its torn tail on disk.

    A file shorter than its header holds nothing (the header is written
    before any chunk): it is reported with ``header=None`` and, with
    ``repair``, removed.
    """
    with open(path, "r+b" if repair else "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < FILE_HEADER_SIZE:
            if repair:
                os.unlink(path)
            return Loaded(path, None, None, 0, size, "torn file header: nothing stored")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                try:
                    header = decode_header(view[:FILE_HEADER_SIZE])
                except (BackupError, ChecksumError) as e:
                    return Loaded(path, None, None, size, 0, f"damaged file header: {e}")
                scan = scan_area(view[FILE_HEADER_SIZE:])
            finally:
                view.release()
        cut = 0
        if scan.cut is not None:
            new_size = FILE_HEADER_SIZE + scan.cut
            cut = size - new_size
            if repair:
                f.truncate(new_size)
                os.fsync(f.fileno())
                size = new_size
        return Loaded(path, header, scan, size, cut)


def create(path: str, broker: int, vlog: int, vseg: int, epoch: int, fsync: bool = False) -> None:
    """Create a new segment file holding only its header (never overwrites one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite_all(fd, [encode_header(broker, vlog, vseg, epoch)], 0)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        fd = -1
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    if fsync:
        fsync_path(os.path.dirname(path) or ".")


def write(path: str, offset: int, parts, trailer: bytes | None = None, fsync: bool = False) -> int:
    """Write ``parts`` at chunk-area ``offset`` (then the trailer), fsync if asked.

    Positional writes make a retry after a failed write idempotent: it
    rewrites the same bytes at the same place. Returns bytes of parts written.
    """
    fd = os.open(path, os.O_WRONLY)
    try:
        n = _pwrite_all(fd, parts, FILE_HEADER_SIZE + offset)
        if trailer is not None:
            _pwrite_all(fd, [trailer], FILE_HEADER_SIZE + offset + n)
        if fsync:
            os.fsync(fd)
        return n
    finally:
        os.close(fd)


def read(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes of the chunk area from ``offset`` (short only if the file is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = os.pread(fd, size, FILE_HEADER_SIZE + offset)
        while len(out) < size:  # pread may return short on some filesystems
            more = os.pread(fd, size - len(out), FILE_HEADER_SIZE + offset + len(out))
            if not more:
                break
            out += more
        return out
    finally:
        os.close(fd)


def _pwrite_all(fd: int, parts, offset: int) -> int:
    vs = iov.views(parts)
    total, i = 0, 0
    while i < len(vs):
        n = os.pwritev(fd, vs[i:i + iov.IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "pwritev wrote nothing")
        offset += n
        total += n
        i = iov.advance(vs, i, n)
    return total
