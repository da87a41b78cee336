"""The backup's process: its command line, the service run until a signal, then flushed.

Run: ``python -m kera.backup.main --dir DIR [--port 0] ...`` (the CLI's ``kera backup
...`` calls ``main(argv)``). When listening it prints one line ``backup <id> listening on
HOST:PORT`` (``-`` while it has no id yet), the address it advertises (``--advertise``,
else ``--host`` and the port bound). On SIGTERM or SIGINT it refuses new data, writes and
fsyncs what it accepted, and exits 0 if nothing is left unwritten.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import trio

from .. import door, metrics
from ..coordinator import link
from ..door import Door
from ..security import secret as secret_
from ..security import tls as tls_
from .scrub import DEFAULT_EVERY, DEFAULT_RATE
from .service import BackupService
from .store import DEFAULT_MAX_MEMORY

log = logging.getLogger("kera.backup")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kera backup", description="Run a kera backup service.")
    p.add_argument("--dir", required=True, help="data directory (segment files, backup.id)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                   help="address brokers and the coordinator reach this backup at (default: "
                        "--host and the port bound)")
    p.add_argument("--coordinator", default=os.environ.get(link.ENV),
                   help="HOST:PORT[,HOST:PORT...] of the coordinators to register with")
    p.add_argument("--node", help="node name (backups and brokers of one node share it)")
    p.add_argument("--fsync", choices=("periodic", "write", "always"), default="write",
                   help="when a replicate is answered: periodic (in memory), write (written to the "
                        "file, survives a killed process; default) or always (fsynced)")
    p.add_argument("--flush-interval", type=float, default=0.05, metavar="SECONDS")
    p.add_argument("--fsync-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--max-bytes", type=int, default=0, help="limit on segment files in DIR (0: none)")
    p.add_argument("--max-memory", type=int, default=DEFAULT_MAX_MEMORY,
                   help="limit on accepted bytes not yet written to disk")
    p.add_argument("--scrub-rate", type=int, default=DEFAULT_RATE, metavar="BYTES_PER_S",
                   help="read every chunk on disk back and verify it, at this rate (0: never)")
    p.add_argument("--scrub-every", type=float, default=DEFAULT_EVERY, metavar="SECONDS",
                   help="a scrubbing pass starts at most this often")
    p.add_argument("--log-level", default="INFO")
    metrics.add_arguments(p)
    secret_.add_arguments(p)
    tls_.add_arguments(p)
    door.add_arguments(p)
    return p


async def _main(args, cluster_secret: bytes, tls) -> bool:
    svc = BackupService(args.dir, fsync=args.fsync, flush_interval=args.flush_interval,
                        fsync_interval=args.fsync_interval, max_bytes=args.max_bytes,
                        max_memory=args.max_memory, coordinator=args.coordinator, node=args.node,
                        scrub_rate=args.scrub_rate, scrub_every=args.scrub_every,
                        cluster_secret=cluster_secret, auth=args.auth, door=Door(door.from_args(args)),
                        tls=tls, advertise=args.advertise)
    if args.metrics_port is not None:
        from ..metrics.backup import install
        install(svc)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as outer:
            if svc.metrics is not None:   # served until the backup has flushed and stopped
                await outer.start(svc.metrics.serve, args.metrics_host or args.host, args.metrics_port)
            async with trio.open_nursery() as nursery:
                await nursery.start(svc.run, args.host, args.port)
                print(f"backup {svc.id if svc.id is not None else '-'} listening on {svc.addr}", flush=True)
                async for sig in signals:
                    log.info("signal %d: flushing and exiting", sig)
                    svc.stop()
                    break
            outer.cancel_scope.cancel()
    return not svc.store.dirty


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    cluster_secret = secret_.from_args(ap, args)
    tls = tls_.from_args(ap, args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.makedirs(args.dir, exist_ok=True)
    return 0 if trio.run(_main, args, cluster_secret, tls) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
