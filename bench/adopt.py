"""CPU per adopted segment on a new owner:
``python -m bench.adopt [--segments N] [--rows R] [--run K]``.

Runs the broker's ``adopt`` handler in this process on one request of N
segments (R chunk rows each, two vsegs per segment) in index chunks of K
consecutive segments each (a recovery sends one per run of a group's
re-pointed segments; ``--run 1``: one per segment) and reports the best of
several runs in CPU time (``time.process_time``), so the figure holds on a
loaded machine. The two network steps of an adoption are not part of it
(the recovery's ``settle``, beside the replay): the ``claim`` RPC to the
backups and the wait for the index chunks to be durable.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import trio

from kera.broker.adopted import Claims
from kera.broker.replicator import ReplicationHub
from kera.broker.service import BrokerService
from kera.recovery import index_chunk
from kera.stream_meta import StreamMeta
from kera.vlog import VlogMapping


def request(segments: int, rows: int, run: int = 1) -> memoryview:
    """One adopt payload: ``segments`` segments of group 0, in order, ``run`` per index chunk."""
    out = []
    for first in range(0, segments, run):
        tables, copies = [], {}
        for s in range(first, min(first + run, segments)):
            ends = np.arange(1, rows + 1, dtype="<u8") * 16000
            vsegs = np.where(np.arange(rows) < rows // 2, s // 4, s // 4 + 1).astype("<u8")
            tables.append(np.stack([ends, vsegs, np.arange(rows, dtype="<u8") * 16000, np.full(rows, 7, "<u8"),
                                    np.arange(s * rows, (s + 1) * rows, dtype="<u8")], 1))
            copies.update({int(v): [1, 2] for v in np.unique(vsegs)})
        out.append(index_chunk.build(index_chunk.SegmentIndex(
            1, 0, 0, first, 3, 5, np.concatenate(tables), copies, [rows] * len(tables))))
    return memoryview(b"".join(out))


class _Nursery:
    """Replicators are not run: the index chunks are appended, never sent."""

    def start_soon(self, *args) -> None:
        pass


def owner(data_dir: str) -> BrokerService:
    """A broker recovering stream 1's streamlet 0, not serving (no sockets)."""
    svc = BrokerService("127.0.0.1:1", data_dir, "bench", VlogMapping(), cluster_secret=bytes(32))
    svc.nursery = _Nursery()
    svc.membership.lease_until = float("inf")
    svc.claims = Claims(None, lambda: (1, 1), lambda b: "")
    svc.logs.hub = ReplicationHub(None, lambda: (1, 1), lambda b: "", 5.0)   # never run
    svc.assignment.place(StreamMeta(name="big", id=1, streamlets=1, groups=1, replication=3, segment_size=256 << 10,
                           group_segments=1 << 20, owners=((1, 1),)), [0], True, False)
    return svc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.adopt")
    ap.add_argument("--segments", type=int, default=400)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--run", type=int, default=32, help="segments per index chunk")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args(argv)
    payload = request(args.segments, args.rows, args.run)
    best = float("inf")
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.runs):
            svc = owner(d)
            t = time.process_time()
            r = trio.run(svc.rpc_adopt, {"epoch": 0}, payload)
            best = min(best, time.process_time() - t)
            assert r["adopted"] == args.segments, r
    print(f"adopt of {args.segments} segments ({args.rows} chunks each, {args.run} per index chunk) "
          f"in one request: "
          f"{best * 1000:.1f} ms CPU, {best / args.segments * 1e6:.1f} us per segment")


if __name__ == "__main__":
    main()
