"""The backup's file work, run in worker threads: no shared state is touched here.

Loading the segment directory, one flush round's writes (and directory fsync,
and the probe of a disk that failed), reading back with verification, unlinking.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid

import numpy as np

from .. import chunk as chunkfmt
from ..errors import ChecksumError, ProtocolError
from ..metafile import fsync_path
from . import segment_file

log = logging.getLogger("kera.backup")


def read_verified(path: str, start: int, stop: int, starts: list[int], ends: list[int]):
    """Read [start, stop) from the file, verifying each chunk again (disks rot).

    Returns (data, bad) where bad is None or (offset, size, reason) of the first
    chunk that failed; data then holds only the chunks before it.
    """
    data = segment_file.read(path, start, stop - start)
    for s, e in zip(starts, ends, strict=True):
        try:
            h = chunkfmt.verify(data, s - start)
            if h.size != e - s:
                raise ProtocolError("chunk size changed on disk")
        except (ChecksumError, ProtocolError) as err:
            return data[:s - start], (s, e - s, f"read back: {err}")
    return data, None


def gather_headers(buf, starts: np.ndarray) -> bytes:
    """The chunk headers at ``starts`` in ``buf``, packed back to back (``HEADER_DTYPE``
    records): one fancy index, no per-chunk Python. A header past the end of ``buf`` (a
    file cut short) comes as zeros, which no header check passes."""
    n = len(buf)
    fit = starts + chunkfmt.HEADER_SIZE <= n
    if not n or not fit.any():
        return bytes(len(starts) * chunkfmt.HEADER_SIZE)
    heads = np.frombuffer(buf, np.uint8)[np.where(fit, starts, 0)[:, None] + np.arange(chunkfmt.HEADER_SIZE)]
    heads[~fit] = 0
    return heads.tobytes()


def read_headers(path: str, starts: np.ndarray) -> bytes:
    """``gather_headers`` over the file's chunk area, mapped: only the pages holding headers
    are read, and nothing the size of the file is allocated."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= segment_file.FILE_HEADER_SIZE:
            return gather_headers(b"", starts)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)[segment_file.FILE_HEADER_SIZE:]
            try:
                return gather_headers(view, starts)
            finally:
                view.release()


def write_round(jobs, segdir: str, dir_sync: bool, probe: bool):
    """Thread side of a flush round: all file I/O, no shared state touched."""
    results = []
    for path, start, parts, trailer, sync in jobs:
        try:
            segment_file.write(path, start, parts, trailer, sync)
            results.append(None)
        except OSError as e:
            results.append(e)
    extra = None
    try:
        if dir_sync:
            fsync_path(segdir)
        if probe:  # the disk failed earlier and nothing is pending: can we write again?
            p = os.path.join(segdir, f".probe-{uuid.uuid4().hex}")
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, b"probe")
            finally:
                os.close(fd)
                os.unlink(p)
    except OSError as e:
        extra = e
    return results, extra


def sync_round(paths: list[str], segdir: str, dir_sync: bool):
    """Thread side of a sync round: fsync files written earlier (writes to them may go on
    meanwhile) and, if asked, the directory. A file deleted meanwhile (its replica released)
    is skipped by the caller (dropped); one that is not dropped reports the error."""
    results = []
    for path in paths:
        try:
            fsync_path(path)
            results.append(None)
        except OSError as e:
            results.append(e)
    extra = None
    if dir_sync:
        try:
            fsync_path(segdir)
        except OSError as e:
            extra = e
    return results, extra


def load_dir(segdir: str) -> list:
    """Load every segment file in ``segdir``: verify all chunks, cut torn tails, log damage."""
    os.makedirs(segdir, exist_ok=True)
    out, seen = [], {}
    for name in sorted(os.listdir(segdir)):
        path = os.path.join(segdir, name)
        if name.startswith(".probe-"):
            os.unlink(path)
            continue
        key = segment_file.parse_name(name)
        if key is None:
            log.warning("ignoring %s: not a segment file name", path)
            continue
        ld = segment_file.load(path, repair=True)
        if ld.header is None and ld.scan is None and ld.file_size == 0:
            log.warning("%s: %s; removed", path, ld.error)
            continue
        if ld.header is not None:
            hkey = (ld.header.broker, ld.header.vlog, ld.header.vseg)
            if hkey != key:
                log.warning("%s holds segment %s per its header; using that", path, hkey)
                key = hkey
        if key in seen:
            log.error("%s: segment %s is also in %s; ignored (kept on disk)", path, key, seen[key])
            continue
        seen[key] = path
        if ld.error:
            log.error("%s: %s; kept, not served", path, ld.error)
        if ld.cut_bytes:
            log.warning("%s: torn tail of %d bytes cut", path, ld.cut_bytes)
        if ld.scan is not None:
            for c in ld.scan.corrupt:
                log.error("%s: corrupt at offset %d (%d bytes): %s; never served",
                          path, c["offset"], c["length"], c["reason"])
        out.append((ld, key))
    return out


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
