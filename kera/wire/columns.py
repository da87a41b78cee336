"""Column layouts on the wire: rows of little-endian u64s that a backup writes and the
coordinator's recovery planner reads.

A recovery lists what the backups hold and indexes the settled history in rows, not maps
(a million vsegs or chunks must cost arrays, not objects): a listing's intact copies
(backup ``list`` with ``columns``) and an index's chunks (backup ``index``). Both ends
take their widths from here; the planner's own rows (``kera.recovery.repoint_plan``)
carry an index row whole and assert that they do.
"""

from __future__ import annotations

# a closed, intact copy in a listing: the fields of its ``Replica.info`` a recovery plan is
# made from (``kera.recovery.plan.Listing``)
LIST_VLOG, LIST_VSEG, LIST_LENGTH, LIST_CHUNKS, LIST_CHECKSUM = range(5)
PLAIN_COLUMNS = LIST_CHECKSUM + 1

# a chunk in an index answer, from its verified header (``kera.backup.replica.index_rows``):
# its vseg offset and size, its stream, streamlet, group, segment and segment offset, its
# producer and sequence, its flags, its Kafka base offset + 1 (0: none) and its records (what
# a new owner adopting it indexes its partition offsets from)
(IX_VOFF, IX_SIZE, IX_STREAM, IX_STREAMLET, IX_GROUP, IX_SEGMENT, IX_OFFSET, IX_PRODUCER,
 IX_SEQUENCE, IX_FLAGS, IX_KAFKA, IX_RECORDS) = range(12)
INDEX_COLUMNS = IX_RECORDS + 1
# a run of chunks (``kera.backup.replica.index_runs``: one producer's, following each other
# in one segment, one vseg and its partition's offsets): its first chunk's row, IX_SIZE their
# bytes, IX_SEQUENCE the highest, IX_RECORDS their records, then IX_COUNT, how many
IX_COUNT = INDEX_COLUMNS
RUN_COLUMNS = INDEX_COLUMNS + 1

assert PLAIN_COLUMNS == 5 and INDEX_COLUMNS == 12 and RUN_COLUMNS == INDEX_COLUMNS + 1, \
    "a column layout changed: both ends and the recovery planner's rows must change with it"
