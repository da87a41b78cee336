"""``kera stream create|list|describe|alter|delete``: the streams of a cluster."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .options import client, config, coordinator, run


def add_parsers(sub) -> None:
    st = sub.add_parser("stream", help="create, list, describe, delete streams")
    ssub = st.add_subparsers(dest="action", required=True)
    c = client(ssub.add_parser("create"))
    c.add_argument("name", nargs="+", help="one or more names, created in one request")
    c.add_argument("--count", type=int, default=None, metavar="N",
                   help="create NAME-000000 ... NAME-(N-1) for each NAME")
    c.add_argument("--streamlets", type=int, default=None)
    c.add_argument("--groups", type=int, default=None, help="active groups per streamlet (Q)")
    c.add_argument("--replication", type=int, default=None, help="copies (R), default min(3, nodes)")
    c.add_argument("--vlogs", choices=["shared", "per-stream", "per-group"], default=None)
    c.add_argument("--segment-size", type=int, default=None)
    c.add_argument("--group-segments", type=int, default=None, help="segments per group (G)")
    for x in (c, al := client(ssub.add_parser("alter", help="change a stream's retention or compaction"))):
        x.add_argument("--retention-bytes", type=int, default=None, metavar="B",
                       help="retention.bytes: bytes the stream keeps at least, over all its "
                            "streamlets; older whole segments are freed (-1: unbounded)")
        x.add_argument("--retention-ms", type=int, default=None, metavar="MS",
                       help="retention.ms: segments older than this are freed (-1: unbounded)")
        x.add_argument("--cleanup-policy", default=None,
                       choices=["delete", "compact", "compact,delete", "delete,compact"],
                       help="cleanup.policy: compact keeps the latest record per key (default delete)")
        x.add_argument("--delete-retention-ms", type=int, default=None, metavar="MS",
                       help="delete.retention.ms: how long compaction keeps a tombstone (default 1 day)")
        x.add_argument("--segment-ms", type=int, default=None, metavar="MS",
                       help="segment.ms: a compacted stream's newest segment is closed (and so "
                            "compacted) this long after it opened (default 60000)")
    al.add_argument("name")
    ls = client(ssub.add_parser("list"))
    ls.add_argument("pattern", nargs="?", default=None, metavar="PATTERN",
                    help="fnmatch pattern (e.g. 'orders-*'); streams are fetched a page at a time")
    ls.add_argument("--pattern", dest="pattern_opt", default=None, help=argparse.SUPPRESS)
    for a in ("describe", "delete"):
        client(ssub.add_parser(a)).add_argument("name")



def cmd_stream(args) -> None:
    from kera_client import open_admin

    if args.action == "create" and args.count is not None and not 1 <= args.count <= 1_000_000:
        print("error: --count must be between 1 and 1000000 (six-digit suffixes)", file=sys.stderr)
        sys.exit(2)

    async def go():
        async with open_admin(coordinator(args), config(args)) as a:
            if args.action == "create":
                shape = {"streamlets": args.streamlets, "groups": args.groups,
                         "replication": args.replication, "vlogs": args.vlogs,
                         "segment_size": args.segment_size, "group_segments": args.group_segments,
                         "retention_bytes": args.retention_bytes, "retention_ms": args.retention_ms,
                         **_compaction(args)}
                if len(args.name) == 1 and args.count is None:
                    s = await a.create_stream(args.name[0], **shape)
                    print(f"created stream {s.name}: {s.streamlets} streamlets, {s.groups} active "
                          f"groups, replication {s.replication}")
                    return
                if args.count is None:
                    names = args.name
                else:
                    names = [f"{n}-{i:06d}" for n in args.name for i in range(args.count)]
                t0 = time.monotonic()
                created = await a.create_streams(names, **shape)
                span = f"{created[0]['name']} ... {created[-1]['name']}" if created else "none"
                print(f"created {len(created)} streams ({span}) in {time.monotonic() - t0:.2f} s")
            elif args.action == "list":
                async for s in a.iter_streams(args.pattern or args.pattern_opt):
                    print(f"{s.name}\t{s.streamlets} streamlets\tR={s.replication}")
            elif args.action == "describe":
                print(json.dumps((await a.describe_stream(args.name)).to_wire(), indent=2))
            elif args.action == "alter":
                if args.retention_bytes is None and args.retention_ms is None and not _compaction(args):
                    print("error: give --retention-bytes, --retention-ms, --cleanup-policy, "
                          "--delete-retention-ms and/or --segment-ms", file=sys.stderr)
                    sys.exit(2)
                s = await a.alter_stream(args.name, args.retention_bytes, args.retention_ms,
                                         **_compaction(args))
                print(f"altered stream {s.name}: retention.bytes={s.retention_bytes} "
                      f"retention.ms={s.retention_ms} cleanup.policy={s.cleanup_policy}")
            elif args.action == "delete":
                await a.delete_stream(args.name)
                print(f"deleted stream {args.name}")

    run(go)


def _compaction(args) -> dict:
    """The compaction settings given on the command line (Kafka's names, underscored)."""
    opts = {"cleanup_policy": args.cleanup_policy, "delete_retention_ms": args.delete_retention_ms,
            "segment_ms": args.segment_ms}
    return {k: v for k, v in opts.items() if v is not None}


COMMANDS = {"stream": cmd_stream}
