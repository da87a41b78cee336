"""The chunk: a producer-built batch of records for one streamlet, and kera's unit on the wire,
in memory and on disk.

- ``layout``: its bytes (header, flags, the records' columns) and the checks of one chunk
  (``parse_header``, ``verify``) or of many back to back (``scan``, ``scan_headers``).
- ``builders``: chunks made from records (``build``), from columns (``build_arrays``), or many
  at once (``pack_many``).
- ``view``: a chunk's records as numpy views (``ChunkView``), and compaction's ``rewrite``.
- ``kafka_batch``: Kafka's RecordBatch, which a chunk flagged ``KAFKA`` carries as it arrived
  (its header read and checked, its base offset written; ``kera.kafka`` serves it).
- ``kafka_records``: such a chunk's records in kera's layout (``to_chunk``), which a
  ``ChunkView`` reads: every reader of chunks meets Kafka's here, below ``kera.kafka``.

Every name is handed on here: ``from kera import chunk``, then ``chunk.build``.
"""

from .builders import build, build_arrays, pack_many
from .layout import (
    CLOSE,
    COMPACTED,
    FEW,
    HEADER,
    HEADER_DTYPE,
    HEADER_SIZE,
    INDEX,
    KAFKA,
    MAGIC,
    NO_PLACEMENT,
    SEQ_RESET,
    VERSION,
    ChunkHeader,
    chunk_size,
    headers_ok,
    kafka_offset,
    parse_header,
    place,
    record_room,
    scan,
    scan_headers,
    seal,
    set_kafka_offset,
    verify,
    with_flags,
)
from .view import ChunkView, original_indices, rewrite, skip_in, skip_out

__all__ = ["CLOSE", "COMPACTED", "FEW", "HEADER", "HEADER_DTYPE", "HEADER_SIZE", "INDEX", "KAFKA", "MAGIC",
           "NO_PLACEMENT", "SEQ_RESET", "VERSION", "ChunkHeader", "ChunkView", "build", "build_arrays",
           "chunk_size", "headers_ok", "kafka_offset", "original_indices", "pack_many", "parse_header", "place",
           "record_room", "rewrite", "scan", "scan_headers", "seal", "set_kafka_offset", "skip_in", "skip_out", "verify",
           "with_flags"]
