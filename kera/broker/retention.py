"""Retention: a streamlet's oldest segments freed, whole, once the stream's retention
(Kafka's ``retention.bytes`` and ``retention.ms``) no longer keeps them; ``segment.ms``
rolling an idle stream's active segments; and compaction's emptied segments going the same
way. Each returns the segments freed: the caller (``kera.broker.reclaim``) releases their
memory and their share of their vsegs.
"""

from __future__ import annotations

from .streamlet import Streamlet


def roll(sl: Streamlet, now: float) -> None:
    """Kafka's ``segment.ms``: an active segment older than it takes no more chunks (the
    next chunk opens a new one), so compaction, which only rewrites closed segments,
    reaches the newest records of a stream that stopped writing."""
    for g in sl.active:
        if g is None or not g.segments:
            continue
        seg = g.segments[-1]
        if seg.head and not seg.filled_at and now - seg.opened_at >= sl.segment_ms / 1000:
            seg.capacity = seg.head
            sl.mark_filled(g, seg)


def expired(sl: Streamlet, now: float, settled_only: bool = True) -> list:
    """Retention: free whole segments, oldest first, while the rest still holds
    ``retention_bytes`` or while the oldest is older than ``retention_ms``. Only segments
    whose chunks are settled on the backups go (the others wait for the next pass).
    Returns the segments freed (the caller releases their memory and vsegs).
    ``settled_only`` False: a streamlet just recovered drops what its dead broker had
    freed already (replayed from vsegs shared with live data) before it serves."""
    out = []
    sl.waiting = None
    rb, rm = sl.retention_bytes, sl.retention_ms
    if rb < 0 and rm < 0:
        return out
    retained = sl.retained_bytes
    while sl.filled:
        g, seg = sl.filled[0]
        old = (rb >= 0 and retained - seg.head >= rb) or \
            (rm >= 0 and seg.filled_at * 1000 <= now * 1000 - rm)
        if not old or g.segments[g.start] is not seg:
            break
        if settled_only and not seg.replicated():
            sl.waiting = seg
            break
        retained -= seg.head
        out.append(_free_first(sl))
    return out


def drop_empty(sl: Streamlet) -> list:
    """Compaction left the oldest segments without a record (every one superseded): they
    go like expired ones, so their vsegs' floors move and the backups delete their files.
    Returns the segments (the caller frees them)."""
    out = []
    while sl.filled:
        g, seg = sl.filled[0]
        if seg.compacted is None or seg.compacted.records or g.segments[g.start] is not seg:
            break
        out.append(_free_first(sl))
    return out


def _free_first(sl: Streamlet):
    """The oldest filled segment, first of its group, goes (the caller frees its bytes)."""
    g, seg = sl.filled.popleft()
    g.free_front()
    sl.freed_bytes += seg.head
    sl.freed_segments += 1
    if g.gone():
        del sl.groups[g.id]
    return seg
