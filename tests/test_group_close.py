"""Close chunks: a full group's close, recorded in its vlog (kera/broker/group_close.py).

- on real processes: a stream whose groups close; the backups' ``index`` lists each
  close chunk at its group's last segment's head; clients cannot produce chunks flagged
  as only brokers flag theirs; after a kill -9 of the owner replayed without re-pointing,
  every acknowledged record reads back once, in order, the closed groups take nothing
  new, and the new owner's vlogs hold the replayed close chunks as they stood;
- an index chunk flagged ``INDEX | CLOSE`` (a closed group's last segment) keeps its
  group closed on the broker adopting it;
- in process: a replayed close keeps a group closed even when no later group of its
  slot was recovered (a chunk that would still fit goes to a new group).
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from kera_client import open_admin, open_consumer

from kera import chunk
from kera.broker.group_close import mark
from kera.broker.streamlet import Streamlet
from kera.errors import InvalidArgument
from kera.recovery import index_chunk
from kera.wire.columns import INDEX_COLUMNS

from .conftest import stream_meta
from .members import open_members
from .test_retention import SIZE, counters, produce, read_all, wait_for, wait_recovered
from .workload import values

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

SEGMENT = 64 << 10
GROUP_SEGMENTS = 2
COLUMNS = INDEX_COLUMNS  # u64s per chunk in a backup's index answer


async def _index_rows(c, addr: str, stream: int) -> np.ndarray:
    """Index rows (vlog, vseg, then the backup's columns) of ``stream``'s chunks in every
    closed vseg of the broker at ``addr``, each asked of one backup holding it."""
    async with open_admin(c.coordinator) as a:
        st = await a.status()
    broker = next(b["id"] for b in st["brokers"] if b["addr"] == addr)
    backups = {b["id"]: b["addr"] for b in st["backups"]}
    out = []
    async with open_members(c) as pool:
        r, _ = await pool.call(addr, "vsegs", {})
        for vlog, vseg, _, closed, copies, _, _ in r["vsegs"]:
            if not closed or not copies:
                continue
            meta, payload = await pool.call(backups[copies[0]], "index",
                                            {"broker": broker, "vsegs": [[vlog, vseg]]})
            data = b"".join(payload) if isinstance(payload, list) else bytes(payload)
            a = np.frombuffer(data[:meta["answers"][0]["rows"]], "<u8").reshape(-1, COLUMNS)
            out.append(np.hstack([np.full((len(a), 2), (vlog, vseg), "<u8"), a]))
    rows = np.vstack(out)
    return rows[rows[:, 4] == stream]


def _check_close_rows(rows: np.ndarray) -> dict[int, tuple[int, int]]:
    """Every close row sits at its group's last segment's head, after the group's chunks in
    the vlog; returns each closed group's (segment, offset) of its close."""
    flags = rows[:, 11]
    close = rows[flags == chunk.CLOSE]
    data = rows[flags == 0]
    assert len(close) and len(close) + len(data) == len(rows), "unexpected flags"
    groups = close[:, 6].tolist()
    assert len(set(groups)) == len(groups), "a group closed twice"
    for vlog, vseg, voff, size, _, _, g, s, off, _, seq, _, _, _ in close.tolist():
        mine = data[(data[:, 6] == g) & (data[:, 7] == s)]
        assert s == GROUP_SEGMENTS - 1 and seq == 0
        assert off == int((mine[:, 8] + mine[:, 3]).max()), "close chunk not at the segment's head"
        before = data[(data[:, 6] == g) & (data[:, 0] == vlog)]
        assert (before[:, 1] * (1 << 40) + before[:, 2] < vseg * (1 << 40) + voff).all(), \
            "a chunk of the group follows its close chunk in the vlog"
        assert size == chunk.chunk_size(1, 0)
    return {g: (s, off) for g, s, off in close[:, 6:9].tolist()}


async def _adopt_closed_last_segment(c, owner: str, rows: np.ndarray) -> int:
    """A broker other than ``owner`` recovers a streamlet of a stream of its own by adopting
    a run of two segments, then a run of three from an index chunk flagged ``INDEX | CLOSE``
    (each segment naming one of ``owner``'s settled chunks, as a recovery would): only the
    third segment is new (an earlier try adopted the first two); then serves it. Returns the
    group a chunk produced there goes to: not the adopted, evicted segments' group, though
    their last segment has room."""
    async with open_admin(c.coordinator) as a:
        st = await a.status()
    src = next(b["id"] for b in st["brokers"] if b["addr"] == owner)
    other = next(b for b in st["brokers"] if b["addr"] != owner)
    vlog, vseg, voff, size = (int(x) for x in rows[rows[:, 11] == 0][0, :4])
    async with open_members(c) as pool:
        r, _ = await pool.call(owner, "vsegs", {})
        copies = next(v[4] for v in r["vsegs"] if (v[0], v[1]) == (vlog, vseg))
        s = stream_meta(id=1 << 40, name="adopted", replication=3, segment_size=SEGMENT,
                        group_segments=GROUP_SEGMENTS)
        e = {"epoch": other["epoch"]}
        backups = [{k: b[k] for k in ("id", "addr", "node", "epoch")} for b in st["backups"]]
        await pool.call(other["addr"], "assign", {**e, "stream": s.to_wire(), "streamlets": [0], "recovering": True,
                                                  "backups": backups})
        def run(n: int) -> index_chunk.SegmentIndex:
            return index_chunk.SegmentIndex(s.id, 0, 0, 0, src, vlog, np.array([[size, vseg, voff, 5, 0]] * n, "<u8"),
                                            {vseg: copies}, [1] * n)

        r, _ = await pool.call(other["addr"], "adopt", e, parts=[index_chunk.build(run(2))])
        assert r["adopted"] == 2
        before = (await pool.call(other["addr"], "stats", {}))[0]["chunks"]
        data = chunk.with_flags(index_chunk.build(run(3)), chunk.INDEX | chunk.CLOSE)
        r, _ = await pool.call(other["addr"], "adopt", e, parts=[data])
        assert r["adopted"] == 3   # the run's segments, held or adopted now
        assert (await pool.call(other["addr"], "stats", {}))[0]["chunks"] == before + 1  # one more
        await pool.call(other["addr"], "assign", {**e, "stream": s.to_wire(), "streamlets": [0]})
        r, _ = await pool.call(other["addr"], "produce", {"positions": True},
                               parts=[chunk.build(s.id, 0, 5, 1, [b"x" * 8])])
        assert not r["errors"], r
        return r["placed"][0][1]


def test_closed_groups_stay_closed_and_replay_once(make_cluster):
    """Groups of 2 x 64 KiB segments close every ~130 records; the owner is killed with -9
    and, re-pointing off, replayed: every acknowledged record reads back once, in order, and
    what is produced after goes to groups that were not closed."""
    c = make_cluster(3, broker_args=["--vseg-size", str(256 << 10)],
                     coordinator_args=["--dead-after", "2.0", "--no-repoint-evicted"])
    n, more = 2000, 300

    async def main():
        async with open_admin(c.coordinator) as a:
            s = await a.create_stream("closing", streamlets=1, replication=3, segment_size=SEGMENT,
                                      group_segments=GROUP_SEGMENTS)
        await produce(c.coordinator, "closing", n, step=100)
        owner = s.addrs[0]
        rows = await _index_rows(c, owner, s.id)
        closed = _check_close_rows(rows)
        assert await _adopt_closed_last_segment(c, owner, rows) == 1

        async with open_members(c) as pool:  # broker-only flags are refused, typed; the rest is served
            r, _ = await pool.call(owner, "stats", {})
            before = r["chunks"]
            good = chunk.build(s.id, 0, 99, 0, list(values(0, n, 1, SIZE)))
            bad = [chunk.build(s.id, 0, 98, 0, [b"x" * 8], flags=f)
                   for f in (chunk.INDEX, chunk.CLOSE, chunk.COMPACTED, chunk.CLOSE | chunk.SEQ_RESET)]
            r, _ = await pool.call(owner, "produce", {"positions": True}, parts=[bad[0], good, *bad[1:]])
            assert sorted(r["errors"]) == [[i, InvalidArgument.code] for i in (0, 2, 3, 4)], r
            assert [p[0] for p in r["placed"]] == [1], r
            with pytest.raises(InvalidArgument):
                await pool.call(owner, "append_if", {"expect": [0, 0]},
                                parts=[chunk.build(s.id, 0, 97, 0, [b"v"], keys=[b"k"], flags=chunk.CLOSE)])
            r, _ = await pool.call(owner, "stats", {})
            assert r["chunks"] == before + 1, "a refused chunk was stored"

        c.kill(next(name for name, addr in c.addrs.items() if addr == owner))
        rec = await wait_recovered(c, s, timeout=60)
        got = (await read_all(c.coordinator, ["closing"], idle=2.0))["closing"]
        await produce(c.coordinator, "closing", more, start=n + 1, step=100)
        after: dict[int, list] = {}
        async with open_consumer(["closing"], c.coordinator, start="earliest") as cons:
            seen = 0

            async def all_read():
                nonlocal seen
                for ch in await cons.poll_chunks(1.0):
                    assert len(counters(ch)) == len(ch.view), "a record that was not produced"
                    after.setdefault(ch.group, []).append(counters(ch))
                    seen += len(ch.view)
                return seen >= n + 1 + more

            await wait_for(all_read, "every record after the recovery", timeout=60, every=0)
        async with open_admin(c.coordinator) as a:
            new_owner = (await a.describe_stream("closing")).addrs[0]
        # the replayed closes were appended again to the new owner's vlogs, as they stood
        again = _check_close_rows(await _index_rows(c, new_owner, s.id))
        return rec, closed, got, after, again

    rec, closed, got, after, again = trio.run(main)
    kept = closed.keys() & again.keys()
    assert kept and all(again[g] == closed[g] for g in kept), (closed, again)
    assert not rec["lost"] and rec["adopted_segments"] == 0, rec
    assert (got == np.arange(n + 1, dtype=np.uint64)).all(), "not every record once, in order"
    new = {g for g, cs in after.items() if (np.concatenate(cs) > n).any()}
    assert new and not new & closed.keys() and min(new) > max(closed), (sorted(closed), sorted(new))
    print(f"\n{len(closed)} close chunks listed, {len(kept)} of them listed again on the new owner; "
          f"recovery replayed {rec['bytes']} bytes in {rec['seconds']} s; records after it went to "
          f"groups {sorted(new)}")


def test_replayed_close_keeps_a_group_closed_without_a_successor():
    """The chunk that did not fit may be lost with its broker: the close chunk alone keeps
    the group closed, so a smaller chunk that would fit goes to a new group."""
    sl = Streamlet(stream_meta(segment_size=1024, group_segments=1), 0)
    sl.recovering = True
    c = bytearray(chunk.build(1, 0, 5, 0, [b"x" * 600]))
    chunk.place(c, 0, 0, 0, 0)
    sl.place(bytes(c), 5, 0, 0, 0)
    mark(sl, 0)
    mark(sl, 3)   # a group freed on the dead broker: its id is not given again
    sl.finish_recovery()
    g, seg, off = sl.append(chunk.build(1, 0, 5, 1, [b"y" * 100]), 5)
    assert (g.id, seg.id, off) == (4, 0, 0) and sl.groups[0].closed
