"""OffsetCommit and OffsetFetch: Kafka's committed offsets as kera's consumer-group positions.

A group's commits are records of kera's positions stream (``kera.group_positions``), on
the streamlet its coordinator owns: one keyed record per (group, topic), its value kera's
``[stream_id, [[streamlet, low, {group: pos}, {group: [pos, skip]}, offset, metadata],
...]]``, so kera's consumers (and the lag kera measures) read a Kafka consumer's commits as
positions, and Kafka consumers read kera's commits as offsets. A Kafka offset is turned
into a kera position, and back, by the broker owning the partition (``kafka_map``: a
bisection in its ``OffsetLog``), asked in one request per broker. A commit is appended
with acks=all to the local streamlet, answered once durable; a fetch reads what was
appended to it since the last one (kera's consumers commit there directly).
"""

from __future__ import annotations

import msgpack
import trio
from kio.schema.errors import ErrorCode

from .. import chunk, group_positions
from ..errors import InvalidArgument, KeraError
from ..position import DONE, pack, unpack
from . import codes

READ = 4 << 20


# -- offsets <-> positions, on the partition's owner ---------------------------------------
def position_of(sl, x: int) -> list:
    """[low, {group: pos}, {group: [pos, skip]}]: where a reader that consumed every record
    before offset ``x`` goes on."""
    log = sl.kafka_log()
    i = log.find(x)
    groups, skips = {}, {}
    need = set(sl.groups)
    j = i
    while need and j < len(log) and j - i < 4096:
        gid, si, off = log.place(j)
        if gid in need:
            base = log.base(j)
            groups[gid] = pack(si, off)
            if j == i and x > base:
                skips[gid] = [groups[gid], x - base]
            need.discard(gid)
        j += 1
    for gid in need:   # groups with nothing at or after x: read to their end
        g = sl.groups[gid]
        last = g.segments[-1] if g.segments else None
        groups[gid] = DONE if g.closed else pack(last.id, last.head) if last else 0
    live = [gid for gid, p in groups.items() if p != DONE]
    low = min(live) if live else sl.next_group
    return [low, {g: p for g, p in groups.items() if g >= low}, skips]


def offset_of(sl, low: int, groups: dict, skips: dict) -> int:
    """The offset of the first record a reader at these positions has not consumed."""
    log = sl.kafka_log()
    best = log.next
    for gid, pos in groups.items():
        if gid < low or pos == DONE:
            continue
        si, off = unpack(pos)
        i = _row_at(log, gid, si, off)
        if i is not None:
            skip = skips.get(gid)
            best = min(best, log.base(i) + (skip[1] if skip and skip[0] == pos else 0))
    for gid in sl.groups:   # groups past low not named: read from their start
        if gid >= low and gid not in groups:
            i = _row_at(log, gid, sl.groups[gid].start, 0)
            if i is not None:
                best = min(best, log.base(i))
    return best


def _row_at(log, gid: int, si: int, off: int) -> int | None:
    """The first row of group ``gid`` at or after (si, off) (rows of one group rise with
    their offsets: a bisection when the streamlet has one group at a time, else a walk)."""
    lo, hi = log.first, len(log)
    key = (gid, si, off)
    while lo < hi:   # rows in offset order are in (group, segment, offset) order with Q = 1
        mid = (lo + hi) // 2
        if log.place(mid) < key:
            lo = mid + 1
        else:
            hi = mid
    for i in range(lo, min(len(log), lo + 4096)):
        g, s, o = log.place(i)
        if g == gid and (s, o) >= (si, off):
            return i
    return None


def _mapped(sl) -> bool:
    """Its offsets are indexed: not recovering, no adoption pending."""
    return sl is not None and not sl.recovering and not sl.pending


def kafka_map(broker, meta: dict) -> dict:
    """The broker RPC: ``offsets`` [[stream, streamlet, offset]] as positions, or
    ``positions`` [[stream, streamlet, low, groups, skips]] as offsets."""
    if meta.get("offsets") is not None:
        out = []
        for sid, index, x in meta["offsets"]:
            sl = broker.streamlets.get((sid, index))
            out.append([sid, index, *position_of(sl, x)] if _mapped(sl) else [sid, index, None])
        return {"positions": out}
    out = []
    for e in meta.get("positions") or []:
        try:
            sid, index, low, groups, skips = e
            sl = broker.streamlets.get((sid, index))
            out.append([sid, index, offset_of(sl, low, {int(g): p for g, p in groups.items()},
                                              {int(g): s for g, s in (skips or {}).items()})
                        if _mapped(sl) else None])
        except (TypeError, ValueError, AttributeError):
            raise InvalidArgument("kafka_map positions are [stream, streamlet, low, groups, skips]") from None
    return {"offsets": out}


# -- the coordinator's side ------------------------------------------------------------
class Offsets:
    def __init__(self, gw, coordinator):
        self.gw, self.c = gw, coordinator
        self.read: dict = {}          # positions streamlet -> [low, {group: pos}]
        self.latest: dict = {}        # positions streamlet -> {key: value}
        self.producer: int | None = None
        self.seqs: dict = {}          # positions streamlet -> our next sequence there
        self.lock = trio.Lock()

    async def refresh(self, sl) -> dict:
        """The latest value of every key of the positions streamlet ``sl``, read from where
        the last refresh stopped."""
        key = (sl.stream_id, sl.index)
        low, positions = self.read.setdefault(key, [0, {}])
        latest = self.latest.setdefault(key, {})
        while True:
            got = sl.read(low, positions, READ)
            for gid, _, _, _, nxt in got:
                positions[gid] = nxt
            data = [e for e in got if e[3]]
            if not data:
                return latest
            for gid, si, off, n, _ in data:
                seg = sl.groups[gid].segments[si]
                part = seg.part(off, n)
                if part is None:
                    part = memoryview(await self.gw.broker.tiered.segment(seg, gid))[off:off + n]
                for h, o in chunk.scan(part):
                    v = chunk.ChunkView(part, o, h)
                    latest.update(zip(v.keys(), v.values(), strict=True))

    async def _map(self, streams: dict, meta_of) -> dict:
        """Ask each partition's owner (``meta_of(owner's entries)``); answers by (stream, sl)."""
        by_addr: dict = {}
        for s, entries in streams.values():
            for e in entries:
                addr = s["addrs"][e[1]]
                if addr is not None:
                    by_addr.setdefault(addr, []).append(e)
        out: dict = {}

        async def one(addr, entries):
            try:
                if addr == self.gw.broker.addr:
                    r = kafka_map(self.gw.broker, meta_of(entries))
                else:
                    r, _ = await self.gw.broker.pool.call(addr, "kafka_map", meta_of(entries), timeout=10)
            except KeraError:
                return
            for row in r.get("positions") or r.get("offsets") or []:
                out[(row[0], row[1])] = row[2:]

        async with trio.open_nursery() as n:
            for addr, entries in by_addr.items():
                n.start_soon(one, addr, entries)
        return out

    async def _streams(self, names: list[str]) -> dict:
        from .metadata import streams
        found, _, _ = await streams(self.gw, names)
        return found

    async def commit(self, conn, req, version):
        group = req.group_id
        gen = getattr(req, "generation_id_or_member_epoch", getattr(req, "generation_id", -1))
        err = await self._checked(conn, group, gen, req.member_id)
        result = {t.name: {p.partition_index: err for p in t.partitions} for t in req.topics}
        if err is None:
            await self._commit(conn, group, req.topics, result)
        return {"throttle_time": 0, "topics": [
            {"name": name, "partitions": [{"partition_index": i, "error_code": code or ErrorCode.none}
                                          for i, code in parts.items()]}
            for name, parts in result.items()]}

    async def _checked(self, conn, group: str, gen: int, member: str):
        err = await self.c.refused(conn, group)
        if err is None and gen >= 0:
            err = self.c.stale(self.c.groups.get(group), member, gen)
        return err

    async def _commit(self, conn, group: str, topics, result: dict) -> None:
        found = await self._streams([t.name for t in topics])
        ask = {}
        for t in topics:
            s = found.get(t.name)
            for p in t.partitions:
                if s is None or not 0 <= p.partition_index < s["streamlets"]:
                    result[t.name][p.partition_index] = ErrorCode.unknown_topic_or_partition
                elif not conn.peer.may("read", "stream", t.name):
                    result[t.name][p.partition_index] = ErrorCode.topic_authorization_failed
            if s is not None:
                ask[t.name] = (s, [[s["id"], p.partition_index, p.committed_offset] for p in t.partitions
                                   if result[t.name][p.partition_index] is None])
        mapped = await self._map(ask, lambda es: {"offsets": es})
        sl = self.c.streamlet(group)
        if sl is None:
            for parts in result.values():
                for i in parts:
                    parts[i] = parts[i] or ErrorCode.not_coordinator
            return
        async with self.lock:
            latest = await self.refresh(sl)
            keys, values = [], []
            for t in topics:
                if t.name not in ask:
                    continue
                s = ask[t.name][0]
                k = msgpack.packb([group, t.name])
                entries = _entries(latest.get(k), s["id"])
                for p in t.partitions:
                    if result[t.name][p.partition_index] is not None:
                        continue
                    pos = mapped.get((s["id"], p.partition_index))
                    if pos is None or pos[0] is None:
                        result[t.name][p.partition_index] = ErrorCode.not_leader_or_follower
                        continue
                    entries[p.partition_index] = [p.partition_index, *pos, p.committed_offset,
                                                  p.committed_metadata]
                keys.append(k)
                values.append(msgpack.packb([s["id"], sorted(entries.values())]))
            if keys:
                await self._append(sl, keys, values, result)

    async def _append(self, sl, keys, values, result) -> None:
        broker = self.gw.broker
        try:
            if self.producer is None:
                self.producer = (await self.gw.coordinator("producer_id", {}))["id"]
            key = (sl.stream_id, sl.index)
            seq = self.seqs.get(key, 0)
            data = bytearray(chunk.build(sl.stream_id, sl.index, self.producer, seq, values, keys,
                                         flags=chunk.SEQ_RESET if seq == 0 else 0))
            self.seqs[key] = seq + 1
            g, seg, soff = sl.append(data, self.producer)
            chunk.place(seg.buf, soff, g.id, seg.id, soff, sl.kafka_base)
            vlog = g.vlog or broker.vlog_for(broker.streams[sl.stream_id], sl.index, g)
            idx = vlog.append(seg, soff, len(data), chunk.parse_header(data).body_checksum)
            sl.note_producer(self.producer, seq, vlog, idx, seg, soff + len(data))
            sl.plain_last = sl.appended_chunks
            with trio.fail_after(30):
                await broker._durable({vlog: idx})
            latest = self.latest.setdefault(key, {})
            latest.update(zip(keys, values, strict=True))
        except (KeraError, trio.TooSlowError) as e:
            code = codes.of(e) if isinstance(e, KeraError) else ErrorCode.request_timed_out
            for parts in result.values():
                for i in parts:
                    parts[i] = parts[i] or code

    async def fetch(self, conn, req, version):
        group = req.group_id
        err = await self._checked(conn, group, -1, "")
        out = {"throttle_time": 0, "error_code": err or ErrorCode.none, "topics": ()}
        if err is not None:
            return out
        sl = self.c.streamlet(group)
        latest = await self.refresh(sl)
        mine = {}
        for k, v in latest.items():
            g = group_positions.group_of(k)
            if g == group and v:
                mine[msgpack.unpackb(k)[1]] = v
        wanted = {t.name: list(t.partition_indexes) for t in req.topics} if req.topics is not None \
            else {name: None for name in mine}
        found = await self._streams(list(wanted)) if wanted else {}
        answers, ask = {}, {}
        for name, parts in wanted.items():
            s = found.get(name)
            entries = _entries(mine.get(name), s["id"]) if s is not None else {}
            rows = {}
            for i in (parts if parts is not None else sorted(entries)):
                e = entries.get(i)
                rows[i] = [-1, None] if e is None else [e[4], e[5]] if len(e) >= 6 else None
                if rows[i] is None:
                    ask.setdefault(name, (s, []))[1].append([s["id"], i, e[1], e[2], e[3]])
            answers[name] = (s, rows)
        mapped = await self._map(ask, lambda es: {"positions": es}) if ask else {}
        topics = []
        for name, (s, rows) in answers.items():
            parts = []
            for i, row in rows.items():
                if row is None:
                    got = mapped.get((s["id"], i))
                    row = [got[0] if got and got[0] is not None else -1, None]
                parts.append({"partition_index": i, "committed_offset": row[0],
                              "committed_leader_epoch": -1, "metadata": row[1],
                              "error_code": ErrorCode.none})
            topics.append({"name": name, "partitions": parts})
        out["topics"] = topics
        return out


def _entries(value, sid: int) -> dict:
    """A commit's entries by streamlet (those of another stream id, re-created since: none)."""
    if not value:
        return {}
    try:
        vsid, rows = msgpack.unpackb(value, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return {}
    return {r[0]: list(r) for r in rows} if vsid == sid else {}
