"""What a connection may hold is bounded at the door (``kera.door``), against real sockets.

In-process: a peer that stops reading is cut off by its reply budget or its send deadline;
half-sent large frames hold at most the receive budget over all connections and are cut
by their frame deadline; a handshake not made in time is cut. Against a real broker:
2,000 idle connections and 200 half-sent frames leave a producer on the side its usual
latency and the broker's memory bounded, the per-address cap refuses the next one (typed),
and every straggler is cut by its timeout.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import pytest
import trio
from kera_client import open_admin, open_producer

from kera import frame, wire
from kera.door import Door, DoorLimits
from kera.errors import ConnectionLimit, PeerTooSlow
from kera.limits import MAX_FRAME, MiB
from kera.rpc import Later
from kera.security.gate import Gate
from kera.server import Service

pytestmark = pytest.mark.timeout(180)


class Bulk(Service):
    """Answers ``bulk`` with a MiB, settled at once but written by whoever is free (queued)."""

    rpcs = wire.named({"bulk": wire.Rpc(wire.ANYONE), "echo": wire.Rpc(wire.ANYONE),
                        "ping": wire.Rpc(wire.AUTHENTICATED)})

    def __init__(self, **lim):
        self.door = Door(DoorLimits(**lim))
        self.gate = Gate(None)

    def rpc_bulk(self, meta, payload):
        later = Later()
        later.done(({}, b"b" * MiB))
        return later

    def rpc_echo(self, meta, payload):
        return {}, bytes(payload)

    def rpc_ping(self, meta, payload):
        return {}


async def _serve(nursery, **lim) -> tuple[Bulk, int]:
    svc = Bulk(**lim)
    port = await nursery.start(svc.serve, "127.0.0.1", 0)
    return svc, port


def _connect(port: int, src: str = "127.0.0.1", rcvbuf: int = 0) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def _request(method: str, rid: int = 1, payload: bytes = b"") -> bytes:
    return frame.encode(frame.REQUEST, rid, {"m": method}, payload)


def _half(size: int = 60 * MiB, sent: int = 1 * MiB) -> bytes:
    """The first ``sent`` bytes of a request announcing ``size`` bytes."""
    head = frame.PREFIX.pack(frame.MAGIC, frame.VERSION, frame.REQUEST, 1, 8, size)
    return (head + b"\x81\xa1m\xa4echo" + b"\x00" * sent)[:sent]


async def _until(pred, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


async def test_a_peer_that_does_not_read_is_cut_off_by_its_budget_or_deadline(nursery):
    svc, port = await _serve(nursery, reply_budget=MAX_FRAME, send_timeout=1.0)
    s = await trio.to_thread.run_sync(_connect, port, "127.0.0.1", 4096)
    await trio.to_thread.run_sync(s.sendall, b"".join(_request("bulk", i) for i in range(1, 120)))
    # 119 MiB of answers asked, none read
    await _until(lambda: svc.door.stats["budget_cut"] + svc.door.stats["send_cut"] == 1)
    assert svc.door.stats["budget_cut"] == 1, svc.door.describe()   # queued past 64 MiB
    await _until(lambda: svc.door.open == 0)
    s.close()
    # one large answer never read: cut by the send deadline, with nothing queued behind it
    s = await trio.to_thread.run_sync(_connect, port, "127.0.0.1", 4096)
    await trio.to_thread.run_sync(s.sendall, _request("echo", 1, b"e" * (8 * MiB)))
    await _until(lambda: svc.door.stats["send_cut"] == 1)
    await _until(lambda: svc.door.open == 0)
    s.close()


async def test_half_sent_frames_hold_at_most_the_receive_budget_and_are_cut(nursery):
    budget = MAX_FRAME
    svc, port = await _serve(nursery, receive_budget=budget, frame_timeout=1.5)
    socks = []
    for _ in range(6):   # 6 x 20 MiB of 60 MiB frames: more than the budget
        s = await trio.to_thread.run_sync(_connect, port)
        socks.append(s)
        s.setblocking(False)
    peak = 0
    left = {s: memoryview(_half(sent=20 * MiB)) for s in socks}
    with trio.move_on_after(1.0):
        while any(left.values()):   # round the connections: each begins its frame
            for s, data in left.items():
                try:
                    left[s] = data[s.send(data[:MiB]):]
                except BlockingIOError:
                    pass
            peak = max(peak, svc.door.receiving)
            await trio.sleep(0.01)
    peak = max(peak, svc.door.receiving)
    assert budget <= peak <= budget + len(socks) * MiB, peak   # past it, the others wait
    await _until(lambda: svc.door.stats["frame_cut"] == len(socks))
    await _until(lambda: svc.door.open == 0)
    assert svc.door.receiving == 0
    for s in socks:
        s.close()


async def test_a_connection_that_must_authenticate_and_does_not_is_cut(nursery):
    svc, port = await _serve(nursery, handshake_timeout=0.5)
    svc.gate = Gate(b"k" * 32, auth=True)
    s = await trio.to_thread.run_sync(_connect, port)
    await trio.to_thread.run_sync(s.sendall, _request("ping"))
    got = await trio.to_thread.run_sync(_read_all, s)
    d = frame.FrameDecoder()
    d.feed(got)
    codes = [f.meta["code"] for f in iter(d.next, None)]
    assert codes == ["unauthenticated", PeerTooSlow.code], codes
    assert svc.door.stats["handshake_cut"] == 1
    s.close()


def _read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    while chunk := s.recv(1 << 16):
        out += chunk
    return out


# -- against a real broker -----------------------------------------------------------------

def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def _latencies(coord: str, n: int) -> list[float]:
    """``n`` records one at a time, each waited for (acks all): its round trip."""
    out = []
    async with open_producer(coord, **{"linger.ms": 0}) as p:
        for i in range(n):
            t0 = time.monotonic()
            await p.send("lat", b"r%d" % i)
            await p.flush()
            out.append(time.monotonic() - t0)
    return out


def _open_many(port: int, src: str, n: int) -> list[socket.socket]:
    return [_connect(port, src) for _ in range(n)]


async def test_idle_connections_and_half_sent_frames_leave_a_producer_alone(make_cluster):
    c = make_cluster(1, broker_args=["--idle-timeout", "12", "--frame-timeout", "10"])
    coord = c.coordinator
    async with open_admin(coord) as a:
        s = await a.create_stream("lat", replication=1)
    port = int(s.addrs[0].rsplit(":", 1)[1])
    pid = c.procs["node1-broker"].pid
    before = await _latencies(coord, 200)
    rss0 = _rss(pid)
    idle = []
    for src in ("127.0.0.2", "127.0.0.3"):
        idle += await trio.to_thread.run_sync(_open_many, port, src, 1000)
    extra = await trio.to_thread.run_sync(_connect, port, "127.0.0.2")   # over the per-address cap
    refused = await trio.to_thread.run_sync(_read_all, extra)
    d = frame.FrameDecoder()
    d.feed(refused)
    assert d.next().meta["code"] == ConnectionLimit.code
    half = await trio.to_thread.run_sync(_open_many, port, "127.0.0.4", 200)
    for h in half:
        h.sendall(_half(sent=1 * MiB))
    async with open_admin(coord) as a:
        await _until_async(lambda: _door(a), lambda d: d["open"] >= 2200 and d["receiving"] >= 199 * MiB)
        during = await _latencies(coord, 200)
        rss1 = _rss(pid)
        held = await _door(a)
        # the stragglers go by their timeouts: idle ones after 12 s, half-sent frames after 10 s
        await _until_async(lambda: _door(a), lambda d: d["open"] <= 5, timeout=60)
        cut = await _door(a)
    for x in idle + half + [extra]:
        x.close()
    p50 = (statistics.median(before), statistics.median(during))
    p99 = (statistics.quantiles(before, n=100)[98], statistics.quantiles(during, n=100)[98])
    print(f"produce latency p50 {p50[0] * 1e3:.2f} -> {p50[1] * 1e3:.2f} ms, p99 {p99[0] * 1e3:.2f} -> "
          f"{p99[1] * 1e3:.2f} ms; broker RSS {rss0 / MiB:.0f} -> {rss1 / MiB:.0f} MiB with "
          f"{held['open']} connections open and {held['receiving'] / MiB:.0f} MiB of frames arriving; "
          f"cut: {cut['idle_cut']} idle, {cut['frame_cut']} half-sent, {cut['refused']} refused")
    assert p50[1] <= 5 * p50[0] + 0.01, p50
    assert rss1 - rss0 <= 320 * MiB, (rss0, rss1)
    assert cut["idle_cut"] >= 2000 and cut["frame_cut"] >= 200 and cut["refused"] >= 1, cut


async def _door(admin) -> dict:
    return (await admin.broker_stats())[0]["door"]


async def _until_async(get, pred, timeout: float = 30.0):
    with trio.fail_after(timeout):
        while not pred(await get()):
            await trio.sleep(0.2)


def test_limits_refuse_what_cannot_work():
    for bad in ({"reply_budget": MiB}, {"receive_budget": MiB}, {"idle_timeout": 0},
                {"max_connections": 10, "max_connections_per_addr": 11}):
        with pytest.raises(ValueError):
            DoorLimits(**bad)
    assert os.sysconf("SC_OPEN_MAX") >= 2300, "the door test needs 2,300 open files"
