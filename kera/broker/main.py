"""The broker's command line: ``kera broker`` (``python -m kera.broker.main``)."""

from __future__ import annotations

import argparse
import logging
import os

import trio

from .. import door, limits, metrics
from ..coordinator import link
from ..door import Door
from ..security import secret as secret_
from ..security import tls as tls_
from ..vlog import VlogMapping
from .memory import default_budget
from .service import BrokerService


def _vseg_size(text: str) -> int:
    n = int(text)
    if not 0 < n <= limits.MAX_VSEG_SIZE:
        raise argparse.ArgumentTypeError(f"must be 1..MAX_VSEG_SIZE ({limits.MAX_VSEG_SIZE}), not {n}")
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kera broker")
    ap.add_argument("--coordinator", default=os.environ.get(link.ENV, link.DEFAULT))
    ap.add_argument("--data", default="kera-data/broker")
    ap.add_argument("--node", default="")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                    help="address clients and the coordinator reach this broker at (default: "
                         "--host and the port bound)")
    ap.add_argument("--vlogs", type=int, default=4, help="virtual logs per broker (shared policy)")
    ap.add_argument("--vlog-policy", default="shared", choices=["shared", "per-stream", "per-group"])
    ap.add_argument("--vseg-size", type=_vseg_size, default=limits.DEFAULT_VSEG_SIZE,
                    help=f"virtual segment capacity, bytes (at most MAX_VSEG_SIZE, {limits.MAX_VSEG_SIZE})")
    ap.add_argument("--memory", type=int, default=None,
                    help="bytes of segments this broker keeps in memory; older replicated ones are "
                         "evicted and read back from backups (default: a quarter of the machine's "
                         "RAM; 0: no limit)")
    ap.add_argument("--replicate-timeout", type=float, default=5.0,
                    help="seconds before a silent backup is replaced")
    metrics.add_arguments(ap)
    ap.add_argument("--metrics-top-streams", type=int, default=0, metavar="N",
                    help="per-stream series for the N streams with the most bytes in (default 0: "
                         "none; finding them walks the broker's streamlets at each scrape)")
    secret_.add_arguments(ap)
    tls_.add_arguments(ap)
    door.add_arguments(ap)
    ap.add_argument("--kafka-listener", default=None, metavar="HOST:PORT",
                    help="also serve Kafka's wire protocol here (port 0 picks a free one)")
    ap.add_argument("--kafka-advertise", default="", metavar="HOST[:PORT]",
                    help="the address Kafka clients are told to reach this broker at "
                         "(default: the listener's host and port)")
    args = ap.parse_args(argv)
    cluster_secret = secret_.from_args(ap, args)
    tls = tls_.from_args(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s broker %(levelname)s %(message)s")
    svc = BrokerService(args.coordinator, args.data, args.node or f"{os.uname().nodename}-{os.getpid()}",
                        VlogMapping(args.vlog_policy, args.vlogs), args.vseg_size,
                        args.replicate_timeout,
                        default_budget() if args.memory is None else args.memory,
                        cluster_secret=cluster_secret, auth=args.auth,
                        door=Door(door.from_args(args)), tls=tls)
    svc.advertise = args.advertise
    if args.kafka_listener is not None:
        from ..kafka.gateway import Gateway
        svc.kafka = Gateway(svc, args.kafka_listener, args.kafka_advertise)
    if args.metrics_port is not None:
        from ..metrics.broker import install
        install(svc, args.metrics_top_streams)

    async def run():
        async with trio.open_nursery() as n:
            if svc.metrics is not None:
                await n.start(svc.metrics.serve, args.metrics_host or args.host, args.metrics_port)
            await svc.run(args.host, args.port)

    from ..process import run_until_signal
    run_until_signal(run)


if __name__ == "__main__":
    main()
