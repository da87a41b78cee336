"""Recovery's re-pointing in the simulator: index rows from whole copies, the real plan, checks.

The coordinator's part of ``kera.recovery.repoint`` over simulated backups: each vseg
of a vlog's settled prefix (``RecoveryPlan.settled``) is indexed by one of
its whole copies, asked in the coordinator's order, the next one when a copy
refuses (not closed, known corrupt, rot found reading a reloaded file's
headers, or in a body read back: a vseg whole on fewer copies than its chunks
need is asked verified); the prefix ends at a vseg no copy indexes. The real
``plan_repoint`` decides, ``RecoveryPlan.skip`` drops the vsegs it names and
the replay leaves out chunks below ``replay_from``. ``check`` holds what the
new owners end with to the invariants (see ``World._recover``), among them
that the replay sends no chunk of a group adopted beside it (``Repoint.ended``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..backup.replica import index_runs
from ..recovery.plan import RecoveryPlan
from ..recovery.repoint_plan import (
    COLUMNS,
    RECORDS,
    VLOG,
    VOFF,
    VSEG,
    Repoint,
    answer_rows,
    plan_repoint,
)
from .placement import STREAM


def repoint(plan: RecoveryPlan, backups: dict, rows_of, replayed: frozenset,
            stats: Counter, fail) -> tuple[Repoint, dict]:
    """Index the settled vsegs, plan, and tell the replay plan what to skip. Returns the plan's
    decision and per vlog {vseg: backups holding it whole} (what an index chunk names)."""
    answers, whole = [], {}
    for vlog in plan.vlogs:
        named = whole[vlog] = {}
        for vseg, copies in plan.settled(vlog):
            k = vseg % len(copies)
            rows = None
            for b in copies[k:] + copies[:k]:
                if (rows := backups[b].index(vlog, vseg, rows_of, len(copies) < plan.need)) is not None:
                    break
                stats["index_refused"] += 1
            if rows is None:
                break   # no copy indexes it: the settled prefix ends here, the rest is replayed
            answers.append((vlog, vseg, rows))
            named[vseg] = copies
    rows = np.concatenate([r for *_, r in answers]) if answers else np.zeros((0, COLUMNS), np.uint64)
    settled = {v: list(vs) for v, vs in whole.items()}
    rp = plan_repoint(rows, settled, replayed)
    # a recovery plans from runs of chunks (``index_runs``): the same decisions
    merged = np.concatenate([answer_rows(index_runs(r[:, VOFF:RECORDS + 1]), v, s, True)
                             for v, s, r in answers]) if answers else rows
    stats["index_rows"] += len(rows)
    stats["index_runs"] += len(merged)
    runs = plan_repoint(merged, settled, replayed)
    if _decisions(runs) != _decisions(rp):
        fail(f"the plan from runs of chunks differs from the plan from chunks: "
             f"{_decisions(runs)} against {_decisions(rp)}")
    for vlog, vsegs in rp.skip.items():
        plan.skip(vlog, vsegs)
    return rp, whole


def _decisions(rp: Repoint) -> tuple:
    return ([(a.stream, a.streamlet, a.group, a.segment, a.closed, a.indexed, a.head) for a in rp.adopted],
            rp.replay_from, rp.skip, rp.ended())


def check(world, rp: Repoint, whole: dict, got: dict[int, list[int]]) -> None:
    """The new owners' view after re-pointing and replay (``got``: per vlog, the chunk ids
    replayed and not skipped), against what the broker appended and acknowledged."""
    groups = {(sl.index, g.id): g for sl in world.placement.streamlets for g in sl.groups}
    adopted, closed, placed = _check_adopted(world, rp, whole, groups)
    _check_replayed(world, rp, got, adopted, closed, placed)
    for key, cs in placed.items():
        _group_order(world.fail, key, cs, closed)
    for g in groups.values():
        c = g.close
        if c is not None and c.acked_at is not None and c.cid not in got.get(c.vlog, ()) and \
                (c.streamlet, c.group) not in closed:
            world.fail(f"group {(c.streamlet, c.group)} closed on the dead broker, open on its new owner")


def _check_adopted(world, rp: Repoint, whole: dict, groups: dict) -> tuple[dict, set, dict]:
    """Every adopted segment is its group's chunks in order, closed as its group is, named
    at copies that hold it intact. Returns chunk id -> its Adopted segment, the (streamlet,
    group) known closed by an adopted segment, and each group's chunks in the new owner's
    order so far."""
    chunks, fail = world.chunks, world.fail
    at = {(c.vlog, c.vseg, c.voff): c for c in chunks}
    adopted: dict[int, object] = {}
    closed = set()
    placed: dict[tuple[int, int], list] = {}
    order = [(a.streamlet, a.group, a.segment) for a in rp.adopted]
    if order != sorted(set(order)):
        fail(f"adopted segments out of (streamlet, group, segment) order or twice: {order[:8]}")
    for a in rp.adopted:
        key = (a.streamlet, a.group)
        g = groups[key]
        seg = g.segments[a.segment]
        cs = [at[r[VLOG], r[VSEG], r[VOFF]] for r in a.rows.tolist()]
        if [c.cid for c in cs] != [c.cid for c in seg.chunks]:
            fail(f"adopted segment {a.segment} of group {key} is not its chunks in order: "
                 f"{[c.cid for c in cs][:6]} for {[c.cid for c in seg.chunks][:6]}")
        last = a.segment == len(g.segments) - 1
        if last and not (g.closed and a.closed) or a.closed and not (g.closed and last and a.head == seg.head):
            fail(f"group {key}: segment {a.segment} adopted as {'closed' if a.closed else 'open'}, "
                 f"the group {'closed' if g.closed else 'open'} with {len(g.segments)} segments")
        if a.closed:
            closed.add(key)
            world.stats["adopted_closed"] += 1
        for c in cs:
            if c.cid in adopted:
                fail(f"chunk {c.cid} adopted twice")
            adopted[c.cid] = a
            named = whole.get(c.vlog, {}).get(c.vseg)
            if named is None:
                fail(f"chunk {c.cid} adopted from vseg {c.vseg} of vlog {c.vlog}, not settled")
            if not any(world.backups[b].intact(c) for b in named):
                fail(f"adopted chunk {c.cid}: no copy named ({named}) holds it intact")
            if c.acked_at is None:
                world.stats["adopted_unacked"] += 1
        placed.setdefault(key, []).extend(cs)
    world.stats["adopted_segments"] += len(rp.adopted)
    world.stats["adopted_chunks"] += len(adopted)
    world.stats["skipped_vsegs"] += sum(len(s) for s in rp.skip.values())
    return adopted, closed, placed


def _check_replayed(world, rp: Repoint, got: dict, adopted: dict, closed: set, placed: dict) -> None:
    """Per vlog, what came back (replayed or adopted) is a prefix of what was appended that
    holds every acknowledged chunk, each once, the replay in the vlog's order and sending no
    chunk of a group adopted beside it; the replayed chunks join their groups in ``placed``."""
    chunks, fail = world.chunks, world.fail
    # the groups whose adoption reaches their end are adopted beside the replay: it must
    # send none of their chunks, or one could be placed before the segments ahead of it
    ended = {(sl, g) for _, sl, g in rp.ended()}
    world.stats["adopted_beside"] += len(ended)
    for v in world.vlogs:
        have = got.get(v.id, [])
        late = [cid for cid in have if (chunks[cid].streamlet, chunks[cid].group) in ended]
        if late:
            c = chunks[late[0]]
            fail(f"vlog {v.id}: chunk {c.cid} of group {(c.streamlet, c.group)} replayed, but the "
                 f"group's adoption reaches its end (adopted beside the replay)")
        mine = world.by_vlog[v.id]
        back = set(have)
        if len(back) != len(have):
            fail(f"vlog {v.id}: a chunk replayed twice")
        if back & adopted.keys():
            fail(f"vlog {v.id}: chunk {min(back & adopted.keys())} adopted and replayed")
        # a close chunk whose segment was adopted closed is carried by the adoption
        back |= {c.cid for c in mine if c.cid in adopted or c.seg is None and (c.streamlet, c.group) in closed}
        n = next((i for i, c in enumerate(mine) if c.cid not in back), len(mine))
        if len(back) != n:
            fail(f"vlog {v.id}: what came back is not a prefix of what was appended "
                 f"(chunk {mine[n].cid} missing, {len(back) - n} after it came back)")
        lost = [c.cid for c in mine[n:] if c.acked_at is not None]
        if lost:
            fail(f"vlog {v.id}: {len(lost)} acknowledged chunks lost, first {lost[0]} "
                 f"({len(have)} replayed, {len(back) - len(have)} adopted)")
        if have != sorted(have):   # chunk ids count up in append order
            fail(f"vlog {v.id}: the replay is out of the vlog's order")
        for c in map(chunks.__getitem__, have):
            placed.setdefault((c.streamlet, c.group), []).append(c)


def _group_order(fail, key, cs: list, closed: set) -> None:
    """The new owner places a group's chunks at their headers' (segment, offset): adopted
    segments, then the replayed chunks, each where the one before ended (or a new segment's
    start), a close chunk last, at the group's end; anything else is a hole (``DataLoss``)."""
    seg = end = 0
    for i, c in enumerate(cs):
        if c.seg is None:
            if (c.segment, c.offset) != (seg, end) or i != len(cs) - 1:
                fail(f"group {key}: close chunk {c.cid} at {c.segment}:{c.offset}, the group ends "
                     f"at {seg}:{end}")
            continue
        if (c.segment, c.offset) not in ((seg, end), (seg + 1, 0)) or i == 0 and (c.segment, c.offset) != (0, 0):
            fail(f"group {key} ({STREAM}): chunk {c.cid} at {c.segment}:{c.offset} after {seg}:{end}: "
                 f"a hole before it")
        seg, end = c.segment, c.offset + c.size

