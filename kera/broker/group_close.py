"""A group's close chunk: the vlog's record that a group closed and no chunk follows in it.

A group closes when its last allowed segment has no room for the next chunk
(``Group.append``), which then goes to a new group. Before that chunk is
referenced, the broker appends to the closed group's own vlog a *close
chunk*: one empty record flagged ``chunk.CLOSE``, placed at (group, the last
segment, that segment's head), naming the stream, the streamlet and the
producer whose chunk did not fit (its ``% Q`` is the group's slot), sequence 0.
One broker appends to a vlog in order, so every chunk of the group lies
before it in that vlog: a recovery that lists it knows where the group's last
segment ends (``kera.recovery.repoint_plan`` may take that segment as it stands), and
the group's new owner keeps it closed (``mark``), so a chunk
never lands after it, in memory or in an adopted, evicted last segment.
A replayed close chunk is appended as it stands to the new owner's vlog of
the group (after the group's replayed chunks and index chunks, which come
before it in the replay), so a later failure of the new owner finds it too;
an index chunk flagged ``INDEX | CLOSE`` carries the close itself.

It lives only in the vlog (a ``VlogChunk``): never in a segment, never read
by consumers, no producer waits on it, and it keeps no vseg live: a vseg
released below the floor held nothing but chunks of segments freed before
it, this group's included. Groups closed otherwise (``Streamlet.seal``,
``finish_recovery``) get none.
"""

from __future__ import annotations

from .. import chunk
from .segment import VlogChunk


def close_chunk(stream_id: int, streamlet: int, g, producer: int) -> VlogChunk:
    """The close chunk of full group ``g`` (its last segment's head is where it ends)."""
    seg = g.segments[-1]
    data = bytearray(chunk.build(stream_id, streamlet, producer, 0, [b""], timestamps=0,
                                 flags=chunk.CLOSE))
    chunk.place(data, 0, g.id, seg.id, seg.head)
    return VlogChunk(bytes(data))


def mark(sl, group: int):
    """Recovery: ``group`` of streamlet ``sl`` was closed on the dead broker: it stays closed
    (``finish_recovery`` makes no closed group active), and its id is never given again.
    Returns the group if this closed it (held here and still open), else None."""
    sl.next_group = max(sl.next_group, group + 1)
    g = sl.groups.get(group)
    if g is None or g.closed:
        return None
    g.closed = True
    return g
