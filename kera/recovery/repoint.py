"""Recovery's re-pointing step: index the settled vsegs, adopt, replay only the rest.

Run by ``kera.recovery.manager`` (on by default; coordinator ``--no-repoint-evicted``
turns it off) after the backups' listings, before any replay step. For each
vlog's settled prefix (``RecoveryPlan.settled``) one whole copy per vseg
lists its chunks without bodies (backup ``index``, asked for many vsegs at
once: a few requests per backup, not one per vseg of the history; the index
chunks of the dead broker's own adoptions come whole; ``kera.recovery.indexing``): each vlog's newest
vsegs a row per chunk, the older ones a row per run of a producer's chunks
(``kera.backup.replica.index_runs``), which plans the same.
``kera.recovery.repoint_plan`` picks the re-pointed segments; each new owner gets one
index chunk per run of a group's consecutive re-pointed segments (``adopt``,
``kera.recovery.index_chunk``) and builds them evicted, naming the copies; the
segments it needs first (the groups the replay continues) get their chunks'
rows again if they were planned from runs. The plan is told which settled
vsegs need no replay at all, and the backups skip the re-pointed segments'
chunks in the vsegs that are replayed. The replay starts once the segments
of the groups it continues are built; the groups whose adoption reaches
their end (``Repoint.ended``: nothing of them is replayed) are adopted after
the hand-over (``kera.recovery.adoption``: ``deferred``), so the time to serve does
not grow with the closed history. What makes an adoption safe (its index
chunks durable, its files claimed: an fsync on each backup) is waited for
beside the replay (``settle``), before the hand-over.

What keeps the adopted chunks readable: the copies named are closed and
whole; the dead incarnation writes and trims no more (fenced); the new owner
claims the files on their backups before it answers ``settle``, so the
backups' letting go of the dead incarnation (``kera.coordinator.recovered``) leaves them
until the owner releases them (``kera.backup.claims``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import trio

from .. import chunk, failpoints, limits
from . import index_chunk
from .indexing import INDEX_TIMEOUT, index
from .plan import RecoveryPlan
from .repoint_plan import (
    COLUMNS,
    COUNT,
    FLAGS,
    GROUP,
    KAFKA,
    OFFSET,
    PRODUCER,
    RECORDS,
    SEGMENT,
    SEQUENCE,
    SIZE,
    STREAM,
    STREAMLET,
    VLOG,
    VOFF,
    VSEG,
    Adopted,
    Repoint,
    plan_repoint,
)

log = logging.getLogger("kera.recovery")



@dataclass
class Repointed:
    replay_from: list       # [[stream id, streamlet, group, first segment replayed], ...]
    settle: Callable        # run beside the replay, before the hand-over
    # (stream id, streamlet) -> (its groups whose adoption reaches their end, each producer's
    # highest sequence in them, a producer of each): adopted after the hand-over
    # (``kera.recovery.adoption``), not here
    deferred: dict = field(default_factory=dict)
    ended: set = field(default_factory=set)   # (stream id, streamlet, group) adopted whole


@dataclass
class _Decided:
    """What the re-pointing planned: from which rows, the plan, what it adopts before the
    replay (``first``) and beside it (``later``, an adoption after a hand-over) or after the
    hand-over (``deferred``), and each vlog's settled vsegs it could index (``whole``)."""

    mine: np.ndarray
    rp: Repoint
    ended: set
    first: list
    deferred: dict
    later: list
    whole: dict


def _asked(plan: RecoveryPlan, settled: dict, runs: bool, newest: int) -> list:
    """The settled vsegs to index, newest first in each vlog: (vlog, vseg, backups holding it
    whole, as runs of chunks or not, verified or not: held whole by fewer backups than
    ``plan.need``, its bodies are read and checked first). A recovery (``runs``) plans the
    older history from runs of chunks (a row per run, ``index_runs``): its groups are closed, adopted after the
    hand-over. The segments it adopts before the replay (groups the replay continues, mostly
    in the newest ``newest`` bytes) need their chunks' own rows (their index chunks name
    every chunk): asked again where only runs came. The adoption after a hand-over builds
    index chunks of all it plans: chunks' rows throughout."""
    items = []
    for vlog, vsegs in settled.items():
        below = 0   # bytes of the vlog's settled vsegs newer than this one
        for vseg, backups in reversed(vsegs):
            items.append((vlog, vseg, backups, runs and below >= newest, len(backups) < plan.need))
            below += plan.vseg_length(vlog, vseg)
    return items


async def repoint(pool, rec, plan: RecoveryPlan, addrs: dict, owners: dict,
                  replayed: frozenset = frozenset(), only: dict | None = None,
                  newest: int = limits.CHUNK_ROWS_NEWEST) -> Repointed:
    """Adopt what can be re-pointed; returns the replay's ``replay_from`` entries, what to
    run beside the replay, before the hand-over (``settle``), and the groups whose adoption
    reaches their end, left for after the hand-over (``deferred``).
    ``owners``: (stream id, streamlet) -> the member recovering it; ``replayed``: the
    (stream id, streamlet) pairs replayed whole, never re-pointed. ``only``: (stream id,
    streamlet) -> groups: the adoption after a hand-over (``kera.recovery.adoption``), of those
    groups alone, into streamlets that serve; ``settle`` then adopts them all, from the
    whole copies of each vseg (``RecoveryPlan.settled``'s ``any_whole``). ``newest``: bytes of
    each vlog's newest settled vsegs a recovery indexes per chunk (older ones as runs)."""
    # after a hand-over nothing of these groups can be replayed any more: a vseg is adopted
    # from its whole copies even if another copy of it is short or damaged
    settled = {v: plan.settled(v, any_whole=only is not None) for v in plan.vlogs}
    with rec.phase("index"):
        answers, indexes, cut = await index(pool, rec.broker, addrs,
                                             _asked(plan, settled, only is None, newest))
    rows = np.concatenate(answers) if answers else np.zeros((0, COLUMNS), np.uint64)
    d = await _decide(pool, rec, addrs, rows, settled, cut, owners, replayed, only, indexes)
    rec.index_rows += len(d.mine)
    rec.index_chunks += int(d.mine[:, COUNT].sum())
    with rec.phase("repoint"):
        per_owner = _requests(rec, d.first, indexes, d.whole, owners)
        members = {m.id: m for m in owners.values()}
    with rec.phase("adopt"):
        async with trio.open_nursery() as n:
            for mid, mine in per_owner.items():
                n.start_soon(_adopt, pool, members[mid], mine)
    for vlog, vsegs in d.rp.skip.items():
        plan.skip(vlog, vsegs)
    rec.adopted_segments += d.rp.segments
    rec.adopted_bytes += d.rp.bytes
    return Repointed([[*k, s] for k, s in d.rp.replay_from.items()],
                     partial(_settle, pool, rec, d, indexes, owners, members, set(per_owner)),
                     d.deferred, d.ended)


async def _decide(pool, rec, addrs: dict, rows: np.ndarray, settled: dict, cut: dict,
                  owners: dict, replayed, only: dict | None, indexes: dict) -> _Decided:
    """The re-pointing planned from the index ``rows`` of the ``settled`` vsegs (each vlog's
    prefix ending where a vseg could not be indexed: ``cut``). A recovery (not ``only``)
    asks again for the chunks' own rows of the segments it adopts before the replay that
    were planned from runs, and plans again with the prefix ending where they could not
    be had."""
    while True:
        with rec.phase("repoint"):
            # the settled prefix ends where a vseg could not be indexed: later ones are replayed
            whole = {v: {s: bs for s, bs in vs if s < cut.get(v, 1 << 62)} for v, vs in settled.items()}
            mine = _recovered(rows, owners, cut, only)
            rp = plan_repoint(mine, {v: list(vs) for v, vs in whole.items()}, replayed)
            ended = rp.ended()
            spans: tuple[list, list] = ([], [])   # adopted before the replay, and after it (or beside)
            for i in range(len(rp.spans)):
                spans[rp.ends(i)].append(i)
            first = list(_runs([a for i in spans[False] for a in rp.span(i)]))
            deferred, later = {}, []
            if only is None:   # a recovery: the groups adopted whole wait for after the hand-over
                deferred = _deferred(rp, spans[True], indexes)
            else:
                later = list(_runs([a for i in spans[True] for a in rp.span(i)]))
        decided = _Decided(mine, rp, ended, first, deferred, later, whole)
        if only is not None:
            return decided
        with rec.phase("index"):
            asked, short = await _chunk_rows(pool, rec.broker, addrs, first, whole)
        rec.reindexed_vsegs += asked
        if not short:
            return decided
        for vlog, vseg in short.items():   # planned again with the prefix ending there
            cut[vlog] = min(cut.get(vlog, vseg), vseg)


async def _adopt(pool, m, mine: list[bytes]) -> None:
    """Index chunks ``mine`` adopted by owner ``m``, up to ``limits.ADOPT_BATCH`` bytes a request."""
    batch, size = [], 0
    for data in mine + [None]:
        if batch and (data is None or size + len(data) > limits.ADOPT_BATCH):
            await pool.call(m.addr, "adopt", {"epoch": m.epoch}, parts=batch, timeout=INDEX_TIMEOUT)
            batch, size = [], 0
        if data is not None:
            batch.append(data)
            size += len(data)


async def _settle(pool, rec, d: _Decided, indexes: dict, owners: dict, members: dict,
                  adopted: set) -> None:
    """Beside the replay: the groups that end in their adoption adopted (the replay sends
    none of their chunks, see ``Repoint.ended``), then each owner's adoptions made durable
    and their files claimed; ``rec.settle_seconds``: how long it took. ``adopted``: the
    owners that adopted before the replay."""
    t = time.monotonic()
    rest: dict[int, list[bytes]] = {}
    for run in d.later:   # a run at a time: the replay's requests go out between them
        await trio.lowlevel.checkpoint()
        for mid, data in _requests(rec, [run], indexes, d.whole, owners).items():
            rest.setdefault(mid, []).extend(data)

    async def one(m) -> None:
        if m.id in rest:
            await _adopt(pool, m, rest[m.id])
            await failpoints.hit("adoption.adopted", m.addr)
        await pool.call(m.addr, "settle", {"epoch": m.epoch}, timeout=INDEX_TIMEOUT)

    async with trio.open_nursery() as n:
        for mid in adopted | rest.keys():
            n.start_soon(one, members[mid])
    rec.settle_seconds = time.monotonic() - t
    log.info("broker %d epoch %d: %d segments (%d bytes) re-pointed at their copies (%d runs "
             "beside the replay), %d vsegs not replayed, index in %.3f s, adopted in %.3f s, settled in "
             "%.3f s", rec.broker, rec.epoch, rec.adopted_segments, rec.adopted_bytes, len(d.later),
             sum(len(v) for v in d.rp.skip.values()), rec.wall["index"], rec.wall["adopt"],
             rec.settle_seconds)


async def _chunk_rows(pool, broker: int, addrs: dict, runs: list, whole: dict) -> tuple[int, dict[int, int]]:
    """The segments of ``runs`` planned from runs of several chunks get their chunks' own
    rows, which their index chunks list, asked of the backups for the vsegs holding them:
    the groups that continue in the replay whose chunks lie in vsegs older than the newest
    ones indexed per chunk, not the history. Returns how many vsegs were asked, and per vlog
    the first vseg whose rows could not be had (no copy indexed it again, or they disagree
    with the runs planned from): the caller plans again with the settled prefix ending
    there, as when the first round could not index it."""
    segs = [a for run in runs for a in run if not a.indexed and a.chunks > len(a.rows)]
    if not segs:   # a run of one chunk is that chunk's row
        return 0, {}
    at = np.concatenate([a.rows[:, [VLOG, VSEG]] for a in segs])
    need = sorted(set(map(tuple, at.tolist())))
    try:
        await failpoints.hit("repoint.chunk_rows", broker)
        # verified already, if they had to be, by the first round
        answers, _, short = await index(pool, broker, addrs,
                                        [(v, s, list(whole[v][s]), False, False) for v, s in need])
    except failpoints.FailpointError as e:   # as if no copy answered
        log.warning("chunks' rows of %d vsegs: %s", len(need), e)
        answers, short = [], {}
    rows = np.concatenate(answers) if answers else np.zeros((0, COLUMNS), np.uint64)
    rows = rows[rows[:, FLAGS] & (chunk.INDEX | chunk.CLOSE) == 0]
    rows = rows[np.lexsort(tuple(rows[:, c] for c in (OFFSET, SEGMENT, GROUP, STREAMLET, STREAM)))]
    key = rows[:, [STREAM, STREAMLET, GROUP, SEGMENT]]
    starts = np.flatnonzero(np.append(True, (key[1:] != key[:-1]).any(axis=1))).tolist() if len(rows) else []
    bounds = starts + [len(rows)]   # a segment's rows: from its start to the next one's
    where = {tuple(key[lo].tolist()): (lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)}
    for a in segs:
        lo, hi = where.get((a.stream, a.streamlet, a.group, a.segment), (0, 0))
        mine = rows[lo:hi]
        end = mine[:, OFFSET] + mine[:, SIZE]
        if (hi - lo == a.chunks and mine[0, OFFSET] == a.rows[0, OFFSET] and int(end[-1]) == a.head
                and (mine[1:, OFFSET] == end[:-1]).all()):
            a.rows = mine
            continue
        vlog, vseg = int(a.rows[0, VLOG]), int(a.rows[:, VSEG].min())
        if vseg < short.get(vlog, 1 << 62):
            log.warning("segment %d of group %d of streamlet %d of stream %d: its chunks' rows (vlog %d "
                        "from vseg %d) disagree with the runs planned from, or could not be had; replayed "
                        "from there", a.segment, a.group, a.streamlet, a.stream, vlog, vseg)
            short[vlog] = vseg
    return len(need), short


def _recovered(rows: np.ndarray, owners: dict, cut: dict[int, int], only: dict | None = None) -> np.ndarray:
    """The rows of streamlets someone recovers (of ``only``'s groups, if given), in vsegs
    before their vlog's ``cut``."""
    if not len(rows):
        return rows
    keep = np.ones(len(rows), bool)
    for vlog, at in cut.items():
        keep &= (rows[:, VLOG] != vlog) | (rows[:, VSEG] < at)
    # (stream, streamlet) as one u64; stream ids are counted up from 1, far below 2**32
    wanted = np.array([(s << 32) | sl for s, sl in owners if s < 1 << 32], np.uint64)
    keep &= rows[:, STREAM] < 1 << 32
    key = (rows[:, STREAM] << np.uint64(32)) | rows[:, STREAMLET]
    keep &= np.isin(key, wanted)
    if only is not None:   # rows sorted by streamlet once, then each streamlet's own rows
        mine = np.zeros(len(rows), bool)
        order = np.argsort(key, kind="stable")
        sk = key[order]
        for (s, sl), gs in only.items():
            if s < 1 << 32:
                k = np.uint64((s << 32) | sl)
                at = order[np.searchsorted(sk, k, "left"):np.searchsorted(sk, k, "right")]
                mine[at] = np.isin(rows[at, GROUP], np.array(sorted(gs), np.uint64))
        keep &= mine
    return rows if keep.all() else rows[keep]


def _deferred(rp: Repoint, spans: list[int], indexes: dict) -> dict:
    """(stream id, streamlet) -> (groups, producer -> highest sequence, group -> one of its
    producers: its slot, ``producer % groups``, [the end of their Kafka offsets]) of the
    plan's ``spans``: the rows of all their records in one pass, not group by group (the
    closed history is most of them)."""
    out: dict = {}
    parts, at = [], []   # the records' (producer, sequence) columns, and their streamlet's number
    slots: dict[tuple[int, int], int] = {}
    for i in spans:
        sid, sl, gid, _, _ = rp.spans[i]
        groups, highest, producers, kafka = out.setdefault((sid, sl), (set(), {}, {}, [0]))
        groups.add(gid)
        rows = rp.records(i)
        if rows is not None:   # records only: all its rows at once
            producers[gid] = int(rows[0, PRODUCER])
            parts.append(rows[:, [PRODUCER, SEQUENCE]])
            at.append(slots.setdefault((sid, sl), len(slots)))
            kafka[0] = max(kafka[0], _kafka_end(rows[:, KAFKA], rows[:, RECORDS]))
            continue
        for a in rp.span(i):
            producers[gid] = int(a.rows[0, PRODUCER])
            if a.indexed:
                r = a.rows[0].tolist()
                ix = index_chunk.parse(indexes[(r[VLOG], r[VSEG], r[VOFF])])
                got = ix.producers()
                end = _kafka_end(ix.rows[:, index_chunk.KAFKA], ix.rows[:, index_chunk.RECORDS])
            else:
                got = index_chunk.highest_sequences(a.rows[:, [OFFSET, VSEG, VOFF, PRODUCER, SEQUENCE]])
                end = _kafka_end(a.rows[:, KAFKA], a.rows[:, RECORDS])
            kafka[0] = max(kafka[0], end)
            for p, q in got.items():
                if q > highest.get(p, -1):
                    highest[p] = q
    if parts:   # per (streamlet, producer) its highest sequence: the last of each once sorted
        ps = np.concatenate(parts)
        who = np.repeat(np.array(at, np.uint64), [len(x) for x in parts])
        o = np.lexsort((ps[:, 1], ps[:, 0], who))
        who, ps = who[o], ps[o]
        last = np.append((who[1:] != who[:-1]) | (ps[1:, 0] != ps[:-1, 0]), True)
        keys = list(slots)
        for k, p, q in zip(who[last].tolist(), ps[last, 0].tolist(), ps[last, 1].tolist(), strict=True):
            highest = out[keys[k]][1]
            if q > highest.get(p, -1):
                highest[p] = q
    return out


def _kafka_end(kafka: np.ndarray, records: np.ndarray) -> int:
    """The end of the Kafka offsets of rows (base + 1, 0 for none; records)."""
    return int(np.max(np.where(kafka > 0, kafka - 1 + records, 0), initial=0))


def _requests(rec, runs: list, indexes: dict, whole: dict, owners: dict) -> dict[int, list[bytes]]:
    """The index chunks of ``runs`` per owner id; the dead broker's own index chunks pass as
    they stand (their segments counted in ``rec``'s adopted figures here)."""
    out: dict[int, list[bytes]] = {}
    for run in runs:
        a = run[0]
        if a.indexed:
            r = a.rows[0].tolist()
            data = indexes[(r[VLOG], r[VSEG], r[VOFF])]
            heads = index_chunk.parse(data).heads
            rec.adopted_bytes += sum(heads)
            rec.adopted_segments += len(heads) - 1
        else:
            data = _index_chunk(rec.broker, run, whole)
        out.setdefault(owners[(a.stream, a.streamlet)].id, []).append(data)
    return out


def _runs(adopted: list[Adopted]):
    """The plan's re-pointed segments as runs, each one index chunk: a group's consecutive
    segments of records (up to ``index_chunk.MAX_ROWS`` chunks), or one index chunk of the
    dead broker's own, as it stands."""
    run: list[Adopted] = []
    rows = 0
    for a in adopted:
        n = a.chunks
        if run and (a.indexed or a.segment != run[-1].segment + 1 or a.group != run[-1].group
                    or (a.stream, a.streamlet) != (run[-1].stream, run[-1].streamlet)
                    or rows + n > index_chunk.MAX_ROWS):
            yield run
            run, rows = [], 0
        if a.indexed:
            yield [a]
            continue
        run.append(a)
        rows += n
    if run:
        yield run


def _index_chunk(broker: int, run: list[Adopted], whole: dict) -> bytes:
    """The index chunk of a run of a group's segments re-pointed at ``broker``'s copies."""
    r = np.concatenate([a.rows for a in run]) if len(run) > 1 else run[0].rows
    rows = r[:, [OFFSET, VSEG, VOFF, PRODUCER, SEQUENCE, KAFKA, RECORDS]]   # one gather
    rows[:, 0] += r[:, SIZE]
    vlog = int(r[0, VLOG])
    vs = r[:, VSEG]   # ascending: a group's chunks are in vlog order (np.unique imports numpy.ma)
    vsegs = vs[np.append(True, vs[1:] != vs[:-1])].tolist()
    a = run[0]
    return index_chunk.build(index_chunk.SegmentIndex(
        a.stream, a.streamlet, a.group, a.segment, broker, vlog, rows,
        {v: list(whole[vlog][v]) for v in vsegs}, [len(x.rows) for x in run]), closed=run[-1].closed)
