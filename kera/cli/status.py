"""``kera status``, ``kera recovery`` and ``kera top``: what a cluster is doing, for a person.

``status`` asks the coordinator's status and every live broker's and backup's stats and
prints them a line per server, vlog, stream, recovery and consumer group (``--json``: all
of it as it came); ``recovery --wait`` draws a progress bar until no recovery is under way.
"""

from __future__ import annotations

import json
import sys

import trio

from ..errors import KeraError
from ..recovery.state import ACTIVE
from .options import client, config, coordinator, run

MIB = 1 << 20


def add_parsers(sub) -> None:
    tp = client(sub.add_parser("top", help="a live view: records/s per broker, memory, replication "
                                           "health, consumer groups' lag (q quits)"))
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print one view and exit")
    s = client(sub.add_parser("status", help="nodes, streams, per-broker and per-vlog counters"))
    s.add_argument("--json", action="store_true")
    rc = client(sub.add_parser("recovery", help="recoveries of dead brokers; --wait shows progress"))
    rc.add_argument("--wait", action="store_true", help="until no recovery is in progress")


def cmd_status(args) -> None:
    from kera_client import open_admin

    async def go():
        async with open_admin(coordinator(args), config(args)) as a:
            st = await a.status()
            st["broker_stats"] = {b["broker"]: b for b in await a.broker_stats(streams=True, status=st)}
            st["backup_stats"] = {b["backup"]: b for b in await a.backup_stats(status=st)}
            return st

    st = run(go)
    if args.json:
        print(json.dumps(st, indent=2))
        return
    c = st.get("coordinators") or {}
    print(f"coordinator {c.get('leader', coordinator(args))} leads: {st['streams']} streams, "
          f"metadata in {c.get('store', '?')}")
    if c.get("standbys"):
        print(f"standby coordinators: {', '.join(c['standbys'])}")
    kafka = [b["kafka"] for b in st["brokers"] if b.get("alive") and b.get("kafka")]
    if kafka:
        print(f"Kafka bootstrap servers: {','.join(kafka)}")
    per_stream: dict = {}
    for b in st["brokers"]:
        _print_broker(b, st["broker_stats"].get(b["id"]) or {}, per_stream)
    for b in st["backups"]:
        own = st["backup_stats"].get(b["id"]) or {}
        print(f"backup {b['id']} {b['addr']} node={b['node']} {'alive' if b['alive'] else 'DEAD'} "
              f"disk={own.get('disk_bytes', 0) / MIB:.1f} MiB in {own.get('segments', 0)} files "
              f"reclaimed={own.get('reclaimed_bytes', 0) / MIB:.1f} MiB "
              f"scrubbed={own.get('scrubbed_bytes', 0) / MIB:.1f} MiB corrupt chunks found={own.get('damage', 0)}")
    _print_streams(per_stream)
    for r in st.get("recoveries", []):
        print(recovery_line(r))
    for g, name, lag, _, pos in (st.get("consumer_lag") or [])[:50]:
        print(f"group {g} stream {name}: lag={lag} records, committed={pos} records")
    ends = _metrics_endpoints(st)
    if ends:
        print("metrics: " + ", ".join(f"{who} http://{addr}/metrics" for who, addr in ends))
    for a in st.get("adoptions", []):
        print(f"adoption of broker {a['broker']} (epoch {a['epoch']})'s closed history after its "
              f"hand-over: {a['groups']} groups of {a['streamlets']} streamlets pending (reads of them "
              f"wait){' ' + a['error'] if a.get('error') else ''}")


def _print_broker(b: dict, own: dict, per_stream: dict) -> None:
    """Broker ``b`` as the coordinator knows it, its own stats ``own`` beside, and its vlogs;
    its streams' figures added to ``per_stream``."""
    s = b.get("stats") or {}
    limit = own.get("memory_limit", s.get("memory_limit", 0))
    used = own.get("memory", s.get("memory", 0)) / MIB
    mem = f"memory={used:.1f}/{limit / MIB:.0f} MiB" if limit else f"memory={used:.1f} MiB (no limit)"
    print(f"broker {b['id']} {b['addr']} node={b['node']} {'alive' if b['alive'] else 'DEAD'} "
          f"streamlets={s.get('streamlets', 0)} chunks={s.get('chunks', 0)} bytes={s.get('bytes', 0)} "
          f"{mem}", end="")
    print(f" evictions={own.get('evictions', 0)} ({own.get('evicted_bytes', 0) / MIB:.1f} MiB) "
          f"freed={own.get('freed_bytes', 0) / MIB:.1f} MiB tiered reads={own.get('tiered_reads', 0)} "
          f"({own.get('tiered_bytes', 0) / MIB:.1f} MiB)")
    rep = own.get("replication") or {}
    if rep:
        print(f"  replicate rpcs={rep['rpcs']} vseg copies={rep['entries']} "
              f"({rep['bytes'] / MIB:.1f} MiB)")
    rb = own.get("rebuild") or {}
    if rb.get("rebuilt") or rb.get("under_replicated") or rb.get("without_copy"):
        print(f"  frozen vsegs: copies made again={rb['rebuilt']} ({rb['rebuilt_bytes'] / MIB:.1f} MiB) "
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


def _print_streams(per_stream: dict) -> None:
    """The first 50 streams by name: what they retain, and where each streamlet starts."""
    shown = sorted(per_stream.items(), key=lambda kv: kv[1]["name"] or str(kv[0]))
    for sid, t in shown[:50]:
        starts = " ".join(f"{i}:{g}.{seg}" for i, (g, seg) in sorted(t["starts"].items(), key=lambda x: int(x[0])))
        print(f"stream {t['name'] or sid}: retained={t['retained'] / MIB:.1f} MiB "
              f"(evicted {t['evicted'] / MIB:.1f}) retention.bytes={t['retention_bytes']} "
              f"retention.ms={t['retention_ms']} start(streamlet:group.segment)={starts}")
    if len(shown) > 50:
        print(f"... {len(shown) - 50} more streams (--json for all)")


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


def recovery_line(r: dict) -> str:
    """A recovery as ``kera status`` and ``kera recovery`` print it."""
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
    from .top import run as top

    try:
        top(coordinator(args), args.interval, args.once)
    except KeraError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


def cmd_recovery(args) -> None:
    """Show recoveries; with --wait, a progress bar until none is in progress."""
    from kera_client import open_admin

    async def go():
        async with open_admin(coordinator(args), config(args)) as a:
            waited = False
            while True:
                recs = (await a.status())["recoveries"]
                active = [r for r in recs if r["state"] in ACTIVE]
                if not args.wait or not active:
                    if waited:
                        print(file=sys.stderr)
                    for r in recs:
                        print(recovery_line(r))
                    return
                waited = True
                done = sum(r["bytes"] for r in active)
                total = max(1, sum(r["total_bytes"] for r in active))
                width = 30
                fill = min(width, int(width * done / total))
                print(f"\rrecovering {len(active)}: [{'#' * fill}{'.' * (width - fill)}] "
                      f"{done / 1e6:.1f}/{total / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)
                await trio.sleep(0.2)

    run(go)


COMMANDS = {"status": cmd_status, "recovery": cmd_recovery, "top": cmd_top}
