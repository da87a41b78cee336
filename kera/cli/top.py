"""``kera top``: a live view of a cluster for a person, redrawn every second.

Asks what ``kera status`` asks (the coordinator's status, every live broker's and
backup's stats) and shows rates from the difference between two answers: records/s
in and out per broker, memory against the budget, replication health (vsegs short
of copies, the durable lag), backups' disks, recoveries, and consumer groups' lag
(measured by a coordinator serving metrics: ``kera.metrics.lag``). Drawn with rich;
``q`` quits.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty

import trio
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..recovery.state import ACTIVE

MIB = 1 << 20


async def snapshot(coordinator: str) -> dict:
    from kera_client import open_admin

    async with open_admin(coordinator) as a:
        st = await a.status()
        st["broker_stats"] = {b["broker"]: b for b in await a.broker_stats(status=st)}
        st["backup_stats"] = {b["backup"]: b for b in await a.backup_stats(status=st)}
    st["at"] = time.monotonic()
    return st


def _rate(now: dict, before: dict | None, key: str, dt: float) -> float:
    if not before or dt <= 0 or key not in before:
        return 0.0
    return max(0, now.get(key, 0) - before[key]) / dt


def render(st: dict, before: dict | None, error: str = "") -> Group:
    c = st.get("coordinators") or {}
    dt = st["at"] - before["at"] if before else 0.0
    active = [r for r in st.get("recoveries", []) if r["state"] in ACTIVE]
    head = Text(f"kera top  coordinator {c.get('leader', '?')}  streams {st['streams']}  "
                f"recoveries in progress {len(active)}  {time.strftime('%H:%M:%S')}  (q quits)",
                style="bold")
    brokers = Table(title="brokers", expand=True)
    for col in ("broker", "state", "in rec/s", "out rec/s", "in MiB/s", "memory", "short vsegs",
                "durable lag"):
        brokers.add_column(col, justify="left" if col == "state" else "right", no_wrap=True)
    for b in st["brokers"]:
        own = st["broker_stats"].get(b["id"]) or {}
        old = (before or {}).get("broker_stats", {}).get(b["id"])
        limit = own.get("memory_limit", 0)
        mem = f"{own.get('memory', 0) / MIB:.1f}/{limit / MIB:.0f} MiB" if limit else \
            f"{own.get('memory', 0) / MIB:.1f} MiB"
        vlogs = own.get("vlogs", [])
        short = sum(v["vsegs"] - v["fully_replicated"] for v in vlogs)
        brokers.add_row(str(b["id"]), "alive" if b["alive"] else "[red]DEAD[/red]",
                        f"{_rate(own, old, 'records_in', dt):,.0f}",
                        f"{_rate(own, old, 'records_out', dt):,.0f}",
                        f"{_rate(own, old, 'bytes_in', dt) / MIB:.2f}", mem,
                        f"[red]{short}[/red]" if short else "0",
                        str(sum(v["lag"] for v in vlogs)))
    backups = Table(title="backups", expand=True)
    for col in ("backup", "state", "disk", "MiB/s written", "corrupt chunks"):
        backups.add_column(col, justify="left" if col == "state" else "right", no_wrap=True)
    for b in st["backups"]:
        own = st["backup_stats"].get(b["id"]) or {}
        old = (before or {}).get("backup_stats", {}).get(b["id"])
        backups.add_row(str(b["id"]), "alive" if b["alive"] else "[red]DEAD[/red]",
                        f"{own.get('disk_bytes', 0) / MIB:.1f} MiB",
                        f"{_rate(own, old, 'bytes_flushed', dt) / MIB:.2f}",
                        str(own.get("damage", 0)))
    groups = Table(title="consumer groups", expand=True)
    for col in ("group", "stream", "lag (records)", "committed (records)"):
        groups.add_column(col, justify="left" if col in ("group", "stream") else "right")
    lag = st.get("consumer_lag")
    for g, s, n, _, pos in (lag or [])[:20]:
        groups.add_row(g, s, f"{n:,}", f"{pos:,}")
    parts = [head, brokers, backups, groups]
    if lag is None:
        parts.append(Text("group lag: the coordinator measures it when started with --metrics-port",
                          style="dim"))
    if error:
        parts.append(Text(f"last refresh failed: {error}", style="red"))
    return Group(*parts)


def run(coordinator: str, interval: float = 1.0, once: bool = False) -> None:
    before = trio.run(snapshot, coordinator)
    if once:
        from rich.console import Console
        Console().print(render(before, None))
        return
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    try:
        if fd is not None:
            tty.setcbreak(fd)
        now, error = before, ""
        with Live(render(now, None), screen=True, auto_refresh=False) as live:
            due = time.monotonic() + interval
            while True:
                wait = max(0.0, due - time.monotonic())
                if fd is not None:
                    ready, _, _ = select.select([fd], [], [], wait)
                    if ready and os.read(fd, 1) in (b"q", b"Q"):
                        return
                else:
                    time.sleep(wait)
                if time.monotonic() < due:
                    continue
                due += interval
                try:
                    now, before = trio.run(snapshot, coordinator), now
                    error = ""
                except Exception as e:  # noqa: BLE001 (the view stays up; it says what failed)
                    error = f"{type(e).__name__}: {e}"
                live.update(render(now, before, error), refresh=True)
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
