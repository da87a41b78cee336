"""The coordinator's process: its command line, and the parts it runs composed.

``kera coordinator ...`` (``kera.cli``) calls ``main(argv, open_log=...)``: the
command line hands in the reader the lag metrics read the positions stream with (the
client's), as a server module never imports the client.
"""

from __future__ import annotations

import argparse
import logging
import os

import trio

from .. import door, metrics
from ..door import Door
from ..limits import CHUNK_ROWS_NEWEST
from ..process import run_until_signal
from ..security import secret as secret_
from ..security import tls as tls_
from .service import Coordinator
from .specs import retention


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kera coordinator")
    ap.add_argument("--data", default="kera-data/coordinator")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7700)
    ap.add_argument("--dead-after", type=float, default=2.0, help="seconds without heartbeat")
    ap.add_argument("--expect-nodes", type=int, default=0,
                    help="answer status only once this many nodes (broker + backup) are up")
    ap.add_argument("--metadata", default=os.environ.get("KERA_METADATA"),
                    help="etcd://HOST:PORT[,HOST:PORT...][/prefix]: keep metadata in etcd and lead "
                         "only while elected there (default: a log in --data)")
    ap.add_argument("--advertise", default="", help="HOST:PORT others reach this coordinator at "
                    "(default: --host:--port)")
    ap.add_argument("--repoint-evicted", action=argparse.BooleanOptionalAction, default=True,
                    help="recovery hands a dead broker's settled segments to their new owners as "
                         "evicted segments read from the backups' copies, instead of replaying "
                         "them (default; --no-repoint-evicted replays everything retained)")
    ap.add_argument("--chunk-rows-newest", type=int, default=CHUNK_ROWS_NEWEST, metavar="BYTES",
                    help="a recovery plans each vlog's settled history from runs of chunks, but for "
                         "its newest BYTES, where the groups it continues mostly lie, from a row per "
                         "chunk (default 8 MiB; 0: runs throughout)")
    ap.add_argument("--retention-bytes", type=int, default=-1,
                    help="default retention.bytes of new streams (-1: unbounded)")
    ap.add_argument("--retention-ms", type=int, default=-1,
                    help="default retention.ms of new streams (-1: unbounded)")
    metrics.add_arguments(ap)
    ap.add_argument("--metrics-lag-interval", type=float, default=2.0, metavar="SECONDS",
                    help="how often consumer groups' lag is measured for the metrics")
    ap.add_argument("--metrics-top-groups", type=int, default=100, metavar="N",
                    help="lag series for the N (group, stream) pairs with the most lag")
    secret_.add_arguments(ap)
    ap.add_argument("--super-users", default="", metavar="PRINCIPALS",
                    help="User:NAME[,User:NAME...]: principals that bypass ACLs (with --auth)")
    tls_.add_arguments(ap)
    door.add_arguments(ap)
    return ap


def main(argv=None, *, open_log) -> None:
    """``open_log``: the reader of the positions stream the lag metrics use (the client's
    ``StreamletLog``, handed in by the command line, which knows the client)."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.chunk_rows_newest < 0:   # before anything is created
        ap.error("--chunk-rows-newest is a number of bytes, 0 or more")
    cluster_secret = secret_.from_args(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    addr = args.advertise or (f"{args.host}:{args.port}" if args.port else "")
    coord = Coordinator(args.data, args.dead_after, args.expect_nodes, args.metadata, addr,
                        cluster_secret=cluster_secret, auth=args.auth,
                        super_users=[p for p in args.super_users.split(",") if p],
                        door=Door(door.from_args(args)), tls=tls_.from_args(ap, args),
                        repoint_evicted=args.repoint_evicted,
                        chunk_rows_newest=args.chunk_rows_newest,
                        retention_defaults=retention({"retention_bytes": args.retention_bytes,
                                                      "retention_ms": args.retention_ms}))
    if args.metrics_port is not None:
        from ..metrics.coordinator import CoordinatorMetrics
        coord.metrics = CoordinatorMetrics(coord, args.metrics_lag_interval, args.metrics_top_groups,
                                           open_log)

    async def run():
        async with trio.open_nursery() as n:
            if coord.metrics is not None:
                await n.start(coord.metrics.run, args.metrics_host or args.host, args.metrics_port)
            port = await n.start(coord.run, args.host, args.port)
            print(f"coordinator listening on {args.host}:{port}", flush=True)

    run_until_signal(run)
