"""The ``kera`` command: servers, a local cluster, and client commands.

Every client command takes ``--coordinator HOST:PORT[,HOST:PORT...]`` (env KERA_COORDINATOR,
default 127.0.0.1:7700) and ``--config FILE`` (env KERA_CONFIG: the security settings,
``kera.security.client_config``). Exit status is non-zero on any error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np
import trio

from . import access_cli, kv_cli
from .errors import KeraError, RecordTooLarge
from .security import client_config

DEFAULT_COORDINATOR = "127.0.0.1:7700"


def _coordinator(args) -> str:
    return args.coordinator or os.environ.get("KERA_COORDINATOR") or DEFAULT_COORDINATOR


def _config(args) -> dict | None:
    """The security settings ``--config`` names (None: those of ``KERA_CONFIG``, if set)."""
    return client_config.read(args.config) if getattr(args, "config", None) else None


def _run(afn, *args):
    try:
        return trio.run(afn, *args)
    except KeraError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        sys.exit(1)


# -- stream admin ---------------------------------------------------------------
def cmd_stream(args) -> None:
    from kera_client import open_admin

    if args.action == "create" and args.count is not None and not 1 <= args.count <= 1_000_000:
        print("error: --count must be between 1 and 1000000 (six-digit suffixes)", file=sys.stderr)
        sys.exit(2)

    async def go():
        async with open_admin(_coordinator(args), _config(args)) as a:
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

    _run(go)


def _compaction(args) -> dict:
    """The compaction settings given on the command line (Kafka's names, underscored)."""
    opts = {"cleanup_policy": args.cleanup_policy, "delete_retention_ms": args.delete_retention_ms,
            "segment_ms": args.segment_ms}
    return {k: v for k, v in opts.items() if v is not None}


# -- produce ----------------------------------------------------------------------
def _producer_options(args) -> dict:
    """The options given on the command line; the producer's own defaults for the others."""
    opts = {"acks": args.acks, "linger.ms": args.linger_ms, "chunk.size": args.chunk_size,
            "request.size": args.request_size, "max.in.flight": args.max_in_flight}
    return {k: v for k, v in opts.items() if v is not None}


def cmd_produce(args) -> None:
    from kera_client import Producer, open_producer

    acked = 0
    ok = True
    try:
        if args.generate is None:
            key = args.key.encode() if args.key is not None else None
            p = Producer(_coordinator(args), {**_producer_options(args), **(_config(args) or {})})
            try:
                for n, line in enumerate(sys.stdin.buffer, 1):
                    value = line.rstrip(b"\n")
                    if args.keyed:   # key<TAB>value; an empty value is a tombstone
                        key, tab, value = value.partition(b"\t")
                        if not tab:
                            print(f"error: line {n}: --keyed needs key<TAB>value", file=sys.stderr, flush=True)
                            ok = False
                            continue
                    try:
                        p.send(args.stream, value, key=key)
                    except RecordTooLarge as e:  # that line only: the others still go
                        print(f"error: line {n}: {e.code}: {e}", file=sys.stderr, flush=True)
                        ok = False
                p.flush()
            finally:
                acked = p.acked
                p.portal.close()
        else:
            acked = 0

            async def one(i, n, counts):
                async with open_producer(_coordinator(args),
                                         {**_producer_options(args), **(_config(args) or {})}) as p:
                    try:
                        rng = np.random.default_rng(i)
                        step = 20_000
                        for start in range(0, n, step):
                            m = min(step, n - start)
                            arr = rng.integers(97, 123, size=(m, args.size), dtype=np.uint8)  # printable
                            await p.send_many(args.stream, arr)
                        await p.flush()
                    finally:
                        counts[i] = p.acked

            async def go():
                counts = [0] * args.producers
                try:
                    async with trio.open_nursery() as nursery:
                        for i in range(args.producers):
                            n = args.generate // args.producers + (i < args.generate % args.producers)
                            nursery.start_soon(one, i, n, counts)
                finally:
                    nonlocal acked
                    acked = sum(counts)

            t0 = time.monotonic()
            trio.run(go)
            dt = time.monotonic() - t0
            print(f"{acked} records in {dt:.2f} s ({acked / max(dt, 1e-9):,.0f} records/s)", file=sys.stderr)
    except (KeraError, KeyboardInterrupt, BaseExceptionGroup) as e:
        print(f"error: {_describe(e)}", file=sys.stderr)
        ok = False
    print(f"acknowledged: {acked}", flush=True)
    if not ok:
        sys.exit(1)


def _describe(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"


# -- consume ------------------------------------------------------------------------
def cmd_consume(args) -> None:
    from kera_client import open_consumer

    count = 0

    async def go():
        nonlocal count
        async with open_consumer([args.stream], _coordinator(args), _config(args), start=args.start,
                                 group=args.group) as c:
            idle_since = time.monotonic()
            out = sys.stdout.buffer
            while args.max is None or count < args.max:
                left = args.timeout - (time.monotonic() - idle_since)
                if left <= 0:
                    break
                chunks = await c.poll_chunks(min(1.0, left))
                if chunks:
                    idle_since = time.monotonic()
                for j, ch in enumerate(chunks):
                    n = len(ch)
                    if args.max is not None:
                        n = min(n, args.max - count)
                    if not args.count_only:
                        values = ch.values()[:n]
                        if args.keys:
                            values = [(k or b"") + b"\t" + v for k, v in zip(ch.keys(), values, strict=False)]
                        out.write(b"".join(v + b"\n" for v in values))
                    count += n
                    if n < len(ch) or (args.max is not None and count >= args.max):
                        # stopped here: the group resumes at the first record not printed
                        c.rewind(chunks[j:] if n < len(ch) else chunks[j + 1:], n if n < len(ch) else 0)
                        break
            if not args.count_only:
                out.flush()
            if args.group:
                await c.commit()

    try:
        trio.run(go)
    except KeraError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        if args.count_only:
            print(count)
        sys.exit(1)
    if args.count_only:
        print(count)


# -- status -----------------------------------------------------------------------------
def cmd_status(args) -> None:
    from kera_client import open_admin

    async def go():
        async with open_admin(_coordinator(args), _config(args)) as a:
            st = await a.status()
            st["broker_stats"] = {b["broker"]: b for b in await a.broker_stats(streams=True, status=st)}
            st["backup_stats"] = {b["backup"]: b for b in await a.backup_stats(status=st)}
            return st

    st = _run(go)
    if args.json:
        print(json.dumps(st, indent=2))
        return
    c = st.get("coordinators") or {}
    print(f"coordinator {c.get('leader', _coordinator(args))} leads: {st['streams']} streams, "
          f"metadata in {c.get('store', '?')}")
    if c.get("standbys"):
        print(f"standby coordinators: {', '.join(c['standbys'])}")
    mib = 1 << 20
    per_stream: dict = {}
    for b in st["brokers"]:
        s = b.get("stats") or {}
        own = st["broker_stats"].get(b["id"]) or {}
        limit = own.get("memory_limit", s.get("memory_limit", 0))
        used = own.get("memory", s.get("memory", 0)) / mib
        mem = f"memory={used:.1f}/{limit / mib:.0f} MiB" if limit else f"memory={used:.1f} MiB (no limit)"
        print(f"broker {b['id']} {b['addr']} node={b['node']} {'alive' if b['alive'] else 'DEAD'} "
              f"streamlets={s.get('streamlets', 0)} chunks={s.get('chunks', 0)} bytes={s.get('bytes', 0)} "
              f"{mem}", end="")
        print(f" evictions={own.get('evictions', 0)} ({own.get('evicted_bytes', 0) / mib:.1f} MiB) "
              f"freed={own.get('freed_bytes', 0) / mib:.1f} MiB tiered reads={own.get('tiered_reads', 0)} "
              f"({own.get('tiered_bytes', 0) / mib:.1f} MiB)")
        rep = own.get("replication") or {}
        if rep:
            print(f"  replicate rpcs={rep['rpcs']} vseg copies={rep['entries']} "
                  f"({rep['bytes'] / mib:.1f} MiB)")
        rb = own.get("rebuild") or {}
        if rb.get("rebuilt") or rb.get("under_replicated") or rb.get("without_copy"):
            print(f"  frozen vsegs: copies made again={rb['rebuilt']} ({rb['rebuilt_bytes'] / mib:.1f} MiB) "
                  f"short of copies={rb['under_replicated']}"
                  + (f" NO WHOLE COPY LEFT={rb['without_copy']}" if rb["without_copy"] else ""))
        for v in s.get("vlogs", []):
            per = v["durable"] / v["messages"] if v["messages"] else 0.0
            print(f"  vlog {v['vlog']} R={v['replication']}: chunks={v['appended']} "
                  f"messages={v['messages']} chunks/message={per:.1f} lag={v['lag']} "
                  f"vsegs={v['vsegs']} "
                  f"with R copies={v['fully_replicated']} released={v.get('released', 0)}")
        for sid, e in (own.get("streams") or {}).items():
            t = per_stream.setdefault(int(sid), {"retained": 0, "evicted": 0, "starts": {}, "name": e.get("name"),
                                                 "retention_bytes": e.get("retention_bytes", -1),
                                                 "retention_ms": e.get("retention_ms", -1)})
            t["retained"] += e["retained"]
            t["evicted"] += e["evicted"]
            t["starts"].update(e["starts"])
    for b in st["backups"]:
        own = st["backup_stats"].get(b["id"]) or {}
        print(f"backup {b['id']} {b['addr']} node={b['node']} {'alive' if b['alive'] else 'DEAD'} "
              f"disk={own.get('disk_bytes', 0) / mib:.1f} MiB in {own.get('segments', 0)} files "
              f"reclaimed={own.get('reclaimed_bytes', 0) / mib:.1f} MiB "
              f"scrubbed={own.get('scrubbed_bytes', 0) / mib:.1f} MiB corrupt chunks found={own.get('damage', 0)}")
    shown = sorted(per_stream.items(), key=lambda kv: kv[1]["name"] or str(kv[0]))
    for sid, t in shown[:50]:
        starts = " ".join(f"{i}:{g}.{seg}" for i, (g, seg) in sorted(t["starts"].items(), key=lambda x: int(x[0])))
        print(f"stream {t['name'] or sid}: retained={t['retained'] / mib:.1f} MiB "
              f"(evicted {t['evicted'] / mib:.1f}) retention.bytes={t['retention_bytes']} "
              f"retention.ms={t['retention_ms']} start(streamlet:group.segment)={starts}")
    if len(shown) > 50:
        print(f"... {len(shown) - 50} more streams (--json for all)")
    for r in st.get("recoveries", []):
        print(_recovery_line(r))
    for g, name, lag, _, pos in (st.get("consumer_lag") or [])[:50]:
        print(f"group {g} stream {name}: lag={lag} records, committed={pos} records")
    ends = _metrics_endpoints(st)
    if ends:
        print("metrics: " + ", ".join(f"{who} http://{addr}/metrics" for who, addr in ends))
    for a in st.get("adoptions", []):
        print(f"adoption of broker {a['broker']} (epoch {a['epoch']})'s closed history after its "
              f"hand-over: {a['groups']} groups of {a['streamlets']} streamlets pending (reads of them "
              f"wait){' ' + a['error'] if a.get('error') else ''}")


def _metrics_endpoints(st: dict) -> list[tuple[str, str]]:
    """(who, HOST:PORT) of every server serving metrics, as they told the coordinator."""
    out = []
    if (st.get("coordinators") or {}).get("metrics"):
        out.append(("coordinator", st["coordinators"]["metrics"]))
    for role in ("broker", "backup"):
        for m in st[f"{role}s"]:
            addr = (m.get("stats") or {}).get("metrics")
            if addr and m.get("alive"):
                out.append((f"{role} {m['id']}", addr))
    return out


def _recovery_line(r: dict) -> str:
    return (f"recovery of broker {r['broker']} (epoch {r['epoch']}): {r['state']}, "
            f"{r['streamlets']} streamlets, {r['vlogs']} vlogs from {r['backups']} backups, "
            f"{r['bytes'] / 1e6:.1f} of {r['total_bytes'] / 1e6:.1f} MB in {r['seconds']} s "
            f"({r['rate_mb_s']} MB/s){' ' + r['error'] if r['error'] else ''}"
            + "".join(f"\n  LOST vlog {x['vlog']} vseg {x['vseg']} bytes {x['offset']}.."
                      f"{'?' if x['end'] is None else x['end']}: {x['reason']}"
                      for x in r.get("lost", []))
            + (f"\n  UNPROVEN: went on without backups {r['unproven']}, which may hold copies"
               if r.get("unproven") else ""))


def cmd_top(args) -> None:
    from .top import run

    try:
        run(_coordinator(args), args.interval, args.once)
    except KeraError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


def cmd_recovery(args) -> None:
    """Show recoveries; with --wait, a progress bar until none is in progress."""
    from kera_client import open_admin

    async def go():
        async with open_admin(_coordinator(args), _config(args)) as a:
            waited = False
            while True:
                recs = (await a.status())["recoveries"]
                active = [r for r in recs if r["state"] in ("planning", "replaying", "waiting")]
                if not args.wait or not active:
                    if waited:
                        print(file=sys.stderr)
                    for r in recs:
                        print(_recovery_line(r))
                    return
                waited = True
                done = sum(r["bytes"] for r in active)
                total = max(1, sum(r["total_bytes"] for r in active))
                width = 30
                fill = min(width, int(width * done / total))
                print(f"\rrecovering {len(active)}: [{'#' * fill}{'.' * (width - fill)}] "
                      f"{done / 1e6:.1f}/{total / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)
                await trio.sleep(0.2)

    _run(go)


# -- servers ------------------------------------------------------------------------------
def cmd_server(args, rest) -> None:
    if args.command == "coordinator":
        from .coordinator.service import main
    elif args.command == "broker":
        from .broker.service import main
    else:
        from .backup.service import main
    main(rest)


def cmd_up(args) -> None:
    from .cluster import LocalCluster

    LocalCluster(args.data, args.nodes, args.port, demo=args.demo,
                 broker_args=shlex.split(args.broker_args), backup_args=shlex.split(args.backup_args),
                 coordinator_args=shlex.split(args.coordinator_args),
                 coordinators=args.coordinators, auth=args.auth, tls=args.tls,
                 metrics_port=args.metrics_port).run()


def _client(p, coord=True):
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT[,HOST:PORT...] of the coordinators (env KERA_COORDINATOR)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="security settings, key=value lines with the Kafka client's names "
                        "(security.protocol, sasl.username, ssl.ca.location...; env KERA_CONFIG)")
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kera", description="kera: stream storage for many small streams")
    sub = ap.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local cluster: a coordinator plus N nodes (broker + backup)")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--data", default="./kera-data")
    up.add_argument("--port", type=int, default=7700)
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
    up.add_argument("--auth", action="store_true",
                    help="user authentication (SCRAM) and ACLs: makes an admin super user, prints "
                         "its password once and writes DATA/client.conf")
    up.add_argument("--tls", action="store_true",
                    help="TLS on every listener: makes a local CA and certificates in DATA/tls "
                         "and writes the CA into DATA/client.conf")

    for role in ("coordinator", "broker", "backup"):
        sub.add_parser(role, help=f"run one {role} process (see kera {role} --help)", add_help=False)

    st = sub.add_parser("stream", help="create, list, describe, delete streams")
    ssub = st.add_subparsers(dest="action", required=True)
    c = _client(ssub.add_parser("create"))
    c.add_argument("name", nargs="+", help="one or more names, created in one request")
    c.add_argument("--count", type=int, default=None, metavar="N",
                   help="create NAME-000000 ... NAME-(N-1) for each NAME")
    c.add_argument("--streamlets", type=int, default=None)
    c.add_argument("--groups", type=int, default=None, help="active groups per streamlet (Q)")
    c.add_argument("--replication", type=int, default=None, help="copies (R), default min(3, nodes)")
    c.add_argument("--vlogs", choices=["shared", "per-stream", "per-group"], default=None)
    c.add_argument("--segment-size", type=int, default=None)
    c.add_argument("--group-segments", type=int, default=None, help="segments per group (G)")
    for x in (c, al := _client(ssub.add_parser("alter", help="change a stream's retention or compaction"))):
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
    ls = _client(ssub.add_parser("list"))
    ls.add_argument("pattern", nargs="?", default=None, metavar="PATTERN",
                    help="fnmatch pattern (e.g. 'orders-*'); streams are fetched a page at a time")
    ls.add_argument("--pattern", dest="pattern_opt", default=None, help=argparse.SUPPRESS)
    for a in ("describe", "delete"):
        _client(ssub.add_parser(a)).add_argument("name")

    p = _client(sub.add_parser("produce", help="produce stdin lines, or --generate synthetic records"))
    p.add_argument("stream")
    p.add_argument("--key", default=None)
    p.add_argument("--keyed", action="store_true", help="stdin lines are key<TAB>value (empty value: tombstone)")
    p.add_argument("--generate", type=int, default=None, metavar="N")
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--acks", choices=["all", "leader", "none"], default=None, help="default all")
    p.add_argument("--linger-ms", type=float, default=None)
    p.add_argument("--chunk-size", type=int, default=None, help="bytes (at most MAX_CHUNK)")
    p.add_argument("--request-size", type=int, default=None, help="bytes (at most MAX_REQUEST)")
    p.add_argument("--max-in-flight", type=int, default=None)

    co = _client(sub.add_parser("consume", help="read records of a stream"))
    co.add_argument("stream")
    co.add_argument("--from", dest="start", choices=["earliest", "latest"], default="earliest")
    co.add_argument("--max", type=int, default=None)
    co.add_argument("--timeout", type=float, default=10.0, help="stop after this long with nothing new")
    co.add_argument("--count-only", action="store_true")
    co.add_argument("--keys", action="store_true", help="print key<TAB>value lines")
    co.add_argument("--group", default=None, help="consumer group: start where it stopped, commit at the end")

    tp = _client(sub.add_parser("top", help="a live view: records/s per broker, memory, replication "
                                           "health, consumer groups' lag (q quits)"))
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print one view and exit")
    s = _client(sub.add_parser("status", help="nodes, streams, per-broker and per-vlog counters"))
    s.add_argument("--json", action="store_true")
    rc = _client(sub.add_parser("recovery", help="recoveries of dead brokers; --wait shows progress"))
    rc.add_argument("--wait", action="store_true", help="until no recovery is in progress")
    kv_cli.add_parser(sub, _client)
    access_cli.add_parsers(sub, _client)
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("coordinator", "broker", "backup"):
        cmd_server(argparse.Namespace(command=argv[0]), argv[1:])
        return
    args = parser().parse_args(argv)
    try:
        {"up": cmd_up, "stream": cmd_stream, "produce": cmd_produce, "consume": cmd_consume,
         "status": cmd_status, "recovery": cmd_recovery, "top": cmd_top,
         "kv": lambda a: kv_cli.cmd_kv(a, _coordinator(a), _config(a), _run),
         "user": lambda a: access_cli.cmd_user(a, _coordinator(a), _config(a), _run),
         "acl": lambda a: access_cli.cmd_acl(a, _coordinator(a), _config(a), _run)}[args.command](args)
    except* BrokenPipeError:
        # the reader of our output went away (``kera stream list | head``): stop quietly, as
        # Unix tools do; stdout goes to /dev/null so the interpreter's final flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)


__all__ = ["main"]
