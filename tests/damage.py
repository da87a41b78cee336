"""Bit rot on purpose: bytes of a file changed in place, as a failing disk would."""

from __future__ import annotations

import os

from kera.backup.segment_file import FILE_HEADER_SIZE


def flip_bits(path: str, offset: int, mask: int = 1) -> None:
    """XOR the byte at ``offset`` of the file with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def flip_middle(path: str) -> None:
    """Rot one byte in the middle of a segment file's chunk area (a chunk's body or header)."""
    size = os.path.getsize(path)
    flip_bits(path, FILE_HEADER_SIZE + (size - FILE_HEADER_SIZE) // 2, 0x5A)
