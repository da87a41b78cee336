"""Recovery's re-pointing step: index the settled vsegs, adopt, replay only the rest.

Run by ``kera.recovery`` (coordinator ``--repoint-evicted``) after the
backups' listings, before any replay step. For each vlog's settled prefix
(``RecoveryPlan.settled``) one whole copy per vseg lists its chunks without
bodies (backup ``index``); ``kera.repoint_plan`` picks the re-pointed
segments; each new owner gets them (``adopt``) as evicted segments naming the
copies; the plan is told which settled vsegs need no replay at all, and the
backups skip the re-pointed segments' chunks in the vsegs that are replayed.

What keeps the adopted chunks readable: the copies named are closed and
whole; the dead incarnation writes and trims no more (fenced), and the end of
the recovery does not drop the vsegs adopted segments point into
(``Recovery.keep``), so nothing deletes those files.
"""

from __future__ import annotations

import logging
import time
from array import array

import trio

from .errors import KeraError
from .recovery_plan import RecoveryPlan
from .repoint_plan import Row, plan_repoint

log = logging.getLogger("kera.recovery")

INDEX_TIMEOUT = 30.0
INDEX_PARALLEL = 8
ADOPT_BATCH = 65536   # chunks per adopt request (3 x 8 bytes each in the payload)


async def repoint(pool, rec, plan: RecoveryPlan, addrs: dict, owners: dict) -> list:
    """Adopt what can be re-pointed; returns the replay's ``replay_from`` entries.
    ``owners``: (stream id, streamlet) -> the member recovering it."""
    t0 = time.monotonic()
    settled = {v: plan.settled(v) for v in plan.vlogs}
    rows: list[Row] = []
    cut: dict[int, int] = {}   # vlog -> first settled vseg no copy could index
    limit = trio.CapacityLimiter(INDEX_PARALLEL)

    async def index(vlog: int, vseg: int, backups: list[int]) -> None:
        async with limit:
            for b in backups:
                try:
                    _, payload = await pool.call(addrs[b], "index", {
                        "broker": rec.broker, "vlog": vlog, "vseg": vseg}, timeout=INDEX_TIMEOUT)
                except KeraError as e:
                    log.warning("index of vlog %d vseg %d on backup %d: %s", vlog, vseg, b, e)
                    continue
                a = array("Q")
                a.frombytes(b"".join(payload) if isinstance(payload, list) else bytes(payload))
                for k in range(0, len(a), 9):
                    r = Row(vlog, vseg, *a[k:k + 9])
                    if (r.stream, r.streamlet) in owners:
                        rows.append(r)
                return
        cut[vlog] = min(cut.get(vlog, vseg), vseg)

    async with trio.open_nursery() as n:
        for vlog, vsegs in settled.items():
            for vseg, backups in vsegs:
                n.start_soon(index, vlog, vseg, backups)
    # the settled prefix ends where a vseg could not be indexed: later ones are replayed
    whole = {v: {s: bs for s, bs in vs if s < cut.get(v, 1 << 62)} for v, vs in settled.items()}
    rows = [r for r in rows if r.vseg in whole[r.vlog]]
    rows.sort(key=lambda r: (r.vlog, r.vseg, r.voff))
    rp = plan_repoint(rows, {v: list(vs) for v, vs in whole.items()})
    rec.index_seconds = time.monotonic() - t0

    per_owner: dict[int, list] = {}
    for a in rp.adopted:
        per_owner.setdefault(owners[(a.stream, a.streamlet)].id, []).append(a)

    async def adopt(m, mine) -> None:
        seqs: dict[tuple, int] = {}
        for a in mine:
            for r in a.rows:
                k = (r.stream, r.streamlet, r.producer)
                seqs[k] = max(seqs.get(k, 0), r.sequence)
        batch: list = []

        async def send(last: bool) -> None:
            used = {(r.vlog, r.vseg) for a in batch for r in a.rows}
            payload = array("Q")
            for a in batch:
                for r in a.rows:
                    payload.extend((r.offset + r.size, r.vseg, r.voff))
            meta = {"epoch": m.epoch, "source": rec.broker,
                    "copies": [[v, s, whole[v][s]] for v, s in sorted(used)],
                    "segments": [[a.stream, a.streamlet, a.group, a.rows[0].producer, a.segment,
                                  a.rows[0].vlog, len(a.rows)] for a in batch],
                    "producers": [[*k, q] for k, q in seqs.items()] if last else []}
            await pool.call(m.addr, "adopt", meta, parts=[payload.tobytes()], timeout=INDEX_TIMEOUT)
            batch.clear()

        chunks = 0
        for a in mine:
            batch.append(a)
            chunks += len(a.rows)
            if chunks >= ADOPT_BATCH:
                await send(False)
                chunks = 0
        await send(True)

    async with trio.open_nursery() as n:
        for mine in per_owner.values():
            n.start_soon(adopt, owners[(mine[0].stream, mine[0].streamlet)], mine)
    for vlog, vsegs in rp.skip.items():
        plan.skip(vlog, vsegs)
    rec.adopted_segments = len(rp.adopted)
    rec.adopted_bytes = rp.bytes
    rec.keep = rp.keep
    log.info("broker %d epoch %d: %d segments (%d bytes) re-pointed at their copies, %d vsegs "
             "not replayed, index in %.2f s", rec.broker, rec.epoch, len(rp.adopted), rp.bytes,
             sum(len(v) for v in rp.skip.values()), rec.index_seconds)
    return [[*k, s] for k, s in rp.replay_from.items()]
