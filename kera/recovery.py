"""RecoveryManager: bring a dead broker's streamlets back from the backups.

A streamlet is orphaned when the incarnation (broker id, epoch) that owns it
is no longer alive: it died, or came back as a new incarnation, or the whole
cluster restarted. For each orphaned incarnation the coordinator:

1. fences it on every live backup (replicas from that epoch are refused, so a
   stale process can never make a write durable again);
2. picks new owners, spread over the live brokers, and assigns them the
   streamlets in *recovering* state (no produce, no pull yet);
3. asks the backups what they hold of that incarnation's virtual logs, and
   has them replay each vlog's virtual segments in order (vlogs in parallel,
   so many backups work at once); a backup pushes each chunk to its
   streamlet's new owner, which places it at the [group, segment, offset]
   its header records and replicates it through its own virtual logs;
4. when every vlog is replayed and durable again, hands the streamlets over
   (owners updated and persisted), and lets backups drop the old replicas.

A recovery that fails (a new owner or a backup died) is abandoned and
planned again from the start; replays are idempotent because placement is.
"""

from __future__ import annotations

import logging
import time

import trio

from .errors import KeraError

log = logging.getLogger("kera.recovery")

REPLAY_TIMEOUT = 600.0
RETRY_DELAY = 0.5


class Recovery:
    def __init__(self, broker: int, epoch: int, streamlets: list):
        self.broker = broker
        self.epoch = epoch
        self.streamlets = streamlets        # [(stream name, index)]
        self.started = time.time()
        self.finished: float | None = None
        self.state = "planning"
        self.vlogs = 0
        self.sources: set[int] = set()      # backups replaying
        self.chunks = 0
        self.bytes = 0
        self.total = 0                      # bytes of the copies chosen for replay
        self.error = ""

    def describe(self) -> dict:
        end = self.finished or time.time()
        return {"broker": self.broker, "epoch": self.epoch, "state": self.state,
                "streamlets": [f"{n}/{i}" for n, i in self.streamlets], "vlogs": self.vlogs,
                "backups": len(self.sources), "chunks": self.chunks, "bytes": self.bytes,
                "total_bytes": self.total,
                "seconds": round(end - self.started, 3),
                "rate_mb_s": round(self.bytes / max(end - self.started, 1e-6) / 1e6, 2),
                "error": self.error}


class RecoveryManager:
    def __init__(self, coord, grace: float):
        self.coord = coord
        self.grace = grace  # after a coordinator start, time for backups to come back
        self.started = time.monotonic()
        self.active: dict[tuple[int, int], Recovery] = {}
        self.history: list[Recovery] = []
        self.not_before: dict[tuple[int, int], float] = {}

    def orphans(self) -> dict[tuple[int, int], list]:
        out: dict[tuple[int, int], list] = {}
        for s in self.coord.meta["streams"].values():
            for i, (b, e) in enumerate(s["owners"]):
                if self.coord.live_broker(b, e) is None:
                    out.setdefault((b, e), []).append((s["name"], i))
        return out

    def _backups_ready(self) -> bool:
        """Every backup ever known is back, or was seen dying, or the grace is over.

        After a whole-cluster restart the replicas are spread over all
        backups: recovering from the first few to come back would hand over
        streamlets with chunks missing.
        """
        known = set(self.coord.meta.get("backups", []))
        seen = set(self.coord.members["backup"])  # registered since this coordinator started
        return known <= seen or time.monotonic() - self.started > self.grace

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(0.1)
                if not self._backups_ready() or not any(
                        m.alive for m in self.coord.members["broker"].values()):
                    continue
                now = time.monotonic()
                if now - self.started < self.coord.dead_after:
                    continue  # after a coordinator restart live brokers rejoin as themselves first
                for key, sls in self.orphans().items():
                    if key not in self.active and self.not_before.get(key, 0) <= now:
                        self.first_try.setdefault(key, now)
                        rec = self.active[key] = Recovery(key[0], key[1], sls)
                        nursery.start_soon(self._run_one, rec)

    async def _run_one(self, rec: Recovery) -> None:
        key = (rec.broker, rec.epoch)
        log.warning("recovering broker %d epoch %d: %d streamlets", rec.broker, rec.epoch,
                    len(rec.streamlets))
        try:
            await self._recover(rec)
            rec.state = "done"
            log.warning("recovered broker %d epoch %d: %s", rec.broker, rec.epoch, rec.describe())
        except Exception as e:  # noqa: BLE001 (a failed attempt is planned again, whatever broke)
            rec.state = "failed"
            rec.error = f"{type(e).__name__}: {e}"
            log.warning("recovery of broker %d epoch %d failed, will retry: %s", rec.broker, rec.epoch, e)
            self.not_before[key] = time.monotonic() + RETRY_DELAY
        finally:
            rec.finished = time.time()
            del self.active[key]
            self.history = (self.history + [rec])[-20:]
            self.coord.notify()

    async def _recover(self, rec: Recovery) -> None:
        coord = self.coord
        backups = [m for m in coord.members["backup"].values() if m.alive]
        # 1. fence the dead incarnation everywhere it could still write
        coord.fence(rec.broker, rec.epoch)
        async with trio.open_nursery() as n:
            for b in backups:  # a backup that does not answer gets the fence when it registers
                n.start_soon(self._quiet, b.addr, "fence", {"broker": rec.broker, "epoch": rec.epoch})
        # 2. new owners, in recovering state
        streams = {s["name"]: s for s in coord.meta["streams"].values()}
        sls = [(n, i) for n, i in rec.streamlets if n in streams]
        targets = coord.spread(len(sls), salt=rec.broker)
        plan: dict[tuple, object] = {}
        per_target: dict[tuple, list[int]] = {}
        for (name, i), m in zip(sls, targets, strict=True):
            plan[(name, i)] = m
            per_target.setdefault((m.id, name), []).append(i)
        try:
            async with trio.open_nursery() as n:
                for (mid, name), idx in per_target.items():
                    n.start_soon(coord.assign, coord.members["broker"][mid], streams[name], idx, True)
            rec.state = "replaying"
            held = await self._replay(rec, backups, streams, plan)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                async with trio.open_nursery() as n:
                    for (mid, name), idx in per_target.items():
                        n.start_soon(self._unassign, coord.members["broker"][mid], streams[name], idx)
            raise
        # 4. hand over: the new owners serve, the metadata says so
        async with trio.open_nursery() as n:
            for (mid, name), idx in per_target.items():
                n.start_soon(coord.assign, coord.members["broker"][mid], streams[name], idx, False)
        for (name, i), m in plan.items():
            streams[name]["owners"][i] = [m.id, m.epoch]
        coord.save()
        async with trio.open_nursery() as n:
            for vlog, vsegs in held.items():
                for vseg, copies in vsegs.items():
                    for _, _, addr in copies:
                        n.start_soon(self._quiet, addr, "drop",
                                     {"broker": rec.broker, "vlog": vlog, "vseg": vseg})

    async def _replay(self, rec, backups, streams, plan) -> dict:
        # 3. what the backups hold of this incarnation, vlog by vlog
        held: dict[int, dict[int, list]] = {}
        for b in backups:  # one that does not answer fails this attempt: it may hold the only copy
            r = await self._call(b.addr, "list", {}, timeout=10)
            for sg in r["segments"]:
                if sg["broker"] == rec.broker and sg["vlog"] >> 32 == rec.epoch:
                    held.setdefault(sg["vlog"], {}).setdefault(sg["vseg"], []).append(
                        (sg["length"], b.id, b.addr))
        routes = [[streams[n]["id"], i, m.addr, m.epoch] for (n, i), m in plan.items()]
        rec.vlogs = len(held)
        rec.total = sum(max(c[0] for c in copies) for vsegs in held.values() for copies in vsegs.values())

        busy: dict[int, int] = {}  # replays given to each backup: spread them, many backups at once

        async def replay_vlog(vlog: int, vsegs: dict[int, list]) -> None:
            for vseg in sorted(vsegs):
                # the longest copy first; among equal ones, the backup with the least to do
                sources = sorted(vsegs[vseg], key=lambda c: (-c[0], busy.get(c[1], 0)))
                busy[sources[0][1]] = busy.get(sources[0][1], 0) + 1
                for i, (_length, bid, addr) in enumerate(sources):
                    try:
                        rec.sources.add(bid)
                        r = await self._call(addr, "replay", {
                            "broker": rec.broker, "vlog": vlog, "vseg": vseg, "routes": routes},
                            timeout=REPLAY_TIMEOUT)
                        rec.chunks += r.get("chunks", 0)
                        rec.bytes += r.get("bytes", 0)
                        break
                    except KeraError as e:
                        if i == len(sources) - 1:
                            raise
                        log.warning("replay of vlog %d vseg %d from backup %d failed (%s); "
                                    "trying another copy", vlog, vseg, bid, e)

        async with trio.open_nursery() as n:
            for vlog, vsegs in held.items():
                n.start_soon(replay_vlog, vlog, vsegs)
        return held

    async def _unassign(self, m, stream, streamlets) -> None:
        try:
            await self._call(m.addr, "unassign", {"stream_id": stream["id"], "streamlets": streamlets})
        except KeraError as e:
            log.info("unassign after a failed recovery: %s", e)

    async def _call(self, addr, method, meta, timeout=30.0):
        r, _ = await self.coord.pool.call(addr, method, meta, timeout=timeout)
        return r

    async def _quiet(self, addr, method, meta) -> None:
        try:
            await self._call(addr, method, meta)
        except KeraError as e:
            log.info("%s on %s failed: %s", method, addr, e)

    def describe(self) -> list[dict]:
        return [r.describe() for r in list(self.active.values()) + self.history[-5:]]
