"""``kera up`` (a local cluster) and ``kera coordinator|broker|backup`` (one server process).

The command line is where the processes are composed: the coordinator's lag metrics read
the positions stream with the client's reader, which the command line hands in (a server
module never imports the client, which stands above the servers).
"""

from __future__ import annotations

import shlex

from ..coordinator.link import PORT

ROLES = ("coordinator", "broker", "backup")


def add_parsers(sub) -> None:
    up = sub.add_parser("up", help="run a local cluster: a coordinator plus N nodes (broker + backup)")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--data", default="./kera-data")
    up.add_argument("--port", type=int, default=PORT)
    up.add_argument("--demo", action="store_true", help="create a stream, produce and consume a little")
    up.add_argument("--broker-args", default="", help="extra arguments for every broker, quoted")
    up.add_argument("--backup-args", default="",
                    help="extra arguments for every backup, quoted (e.g. '--fsync always')")
    up.add_argument("--coordinator-args", default="", help="extra arguments for the coordinator, quoted")
    up.add_argument("--coordinators", type=int, default=1,
                    help="run a local etcd and this many coordinators on it (ports P, P+1, ...): "
                         "one leads, the others take over when it dies")
    up.add_argument("--metrics-port", type=int, default=None, metavar="P",
                    help="serve Prometheus metrics: the coordinators on P, P+1, ..., then each "
                         "node's backup and broker on the next ports")
    up.add_argument("--kafka-port", type=int, default=None, metavar="P",
                    help="every broker also speaks Kafka's wire protocol: node i's on P + i - 1")
    up.add_argument("--auth", action="store_true",
                    help="user authentication (SCRAM) and ACLs: makes an admin super user, prints "
                         "its password once and writes DATA/client.conf")
    up.add_argument("--tls", action="store_true",
                    help="TLS on every listener: makes a local CA and certificates in DATA/tls "
                         "and writes the CA into DATA/client.conf")

    for role in ROLES:
        sub.add_parser(role, help=f"run one {role} process (see kera {role} --help)", add_help=False)


def serve(role: str, argv: list[str]) -> None:
    """One server process of ``role`` with its own command line ``argv``."""
    if role == "coordinator":
        from kera_client.streamlet_log import StreamletLog

        from ..coordinator.main import main
        main(argv, open_log=StreamletLog)
    elif role == "broker":
        from ..broker.main import main
        main(argv)
    else:
        from ..backup.main import main
        main(argv)


def cmd_up(args) -> None:
    from ..cluster import LocalCluster

    LocalCluster(args.data, args.nodes, args.port, demo=args.demo,
                 broker_args=shlex.split(args.broker_args), backup_args=shlex.split(args.backup_args),
                 coordinator_args=shlex.split(args.coordinator_args),
                 coordinators=args.coordinators, auth=args.auth, tls=args.tls,
                 metrics_port=args.metrics_port, kafka_port=args.kafka_port).run()


COMMANDS = {"up": cmd_up}
