"""Small checksummed msgpack files, replaced atomically (write, fsync, rename).

Used for the coordinator's metadata and servers' identities: a torn or
corrupt file is detected by its checksum and refused, never half-read.
"""

from __future__ import annotations

import os
import struct

import msgpack
import xxhash

_HEAD = struct.Struct("<4sIQ")
_MAGIC = b"KMF1"


class CorruptMetaFile(Exception):
    pass


def save(path: str, obj) -> None:
    save_packed(path, msgpack.packb(obj, use_bin_type=True))


def save_packed(path: str, body: bytes) -> None:
    """``save`` for a body already packed (e.g. piecewise, off the event loop)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(_MAGIC, len(body), xxhash.xxh64_intdigest(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def fsync_path(path: str) -> None:
    """Make a file's written bytes, or a directory's entries, durable (through any descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str, default=None):
    try:
        body = load_body(path)
    except FileNotFoundError:
        return default
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def load_body(path: str) -> bytes:
    """The file's msgpack body, checked (``CorruptMetaFile`` otherwise), not decoded."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEAD.size:
        raise CorruptMetaFile(f"{path}: truncated")
    magic, n, check = _HEAD.unpack_from(data)
    body = data[_HEAD.size:]
    if magic != _MAGIC or n != len(body) or xxhash.xxh64_intdigest(body) != check:
        raise CorruptMetaFile(f"{path}: checksum mismatch")
    return body
