"""Bit rot on purpose: bytes of a file changed in place, as a failing disk would."""

from __future__ import annotations


def flip_bits(path: str, offset: int, mask: int = 1) -> None:
    """XOR the byte at ``offset`` of the file with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
