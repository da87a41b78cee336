"""RPC hygiene against a real server on 127.0.0.1: a late reply or error for a request
nobody waits for any more is dropped (the connection stays, unless the peer said nothing
at all while the request waited), and a send cut in the middle of a frame closes its
connection (the server never reads the rest as a request)."""

from __future__ import annotations

import socket
import ssl
from functools import partial

import numpy as np
import pytest
import trio

from kera import wire
from kera.coordinator.link import CoordinatorLink
from kera.errors import Fenced, InvalidArgument, KeraError, NotLeader, Unavailable, UnknownMethod
from kera.iov import IOV_MAX
from kera.limits import TLS_PIECE, TLS_RECORD, VECTOR_FROM
from kera.rpc import Later, advertised, open_pool, send_frame
from kera.rpc.channel import Tls
from kera.security.credentials import Credentials
from kera.server import Service


class SlowReader:
    """The server's side of a connection that hands over what it read only while
    ``svc.reading`` is set (and reads nothing more meanwhile)."""

    def __init__(self, stream: trio.SocketStream, svc: TestService):
        self.stream, self.svc = stream, svc

    async def receive_some(self, max_bytes=None):
        data = await self.stream.receive_some(max_bytes)
        while not self.svc.reading:
            await self.svc.changed.wait()
        return data

    async def send_all(self, data):
        await self.stream.send_all(data)

    @property
    def socket(self):  # large frames of parts go out vectored on the socket itself
        return self.stream.socket

    async def aclose(self):
        await self.stream.aclose()


class TestService(Service):
    __test__ = False
    rpcs = wire.named({
        "echo": wire.Rpc(wire.ANYONE, {"n?": wire.ANY}),
        "slow": wire.Rpc(wire.ANYONE),
        "echo_parts": wire.Rpc(wire.ANYONE, {"cuts": wire.ANY}),
        "big": wire.Rpc(wire.ANYONE),
        "later": wire.Rpc(wire.ANYONE, {"n?": wire.ANY, "now?": wire.ANY, "now_error?": wire.ANY}),
    })

    def __init__(self, rcvbuf: int = 4096):
        self.rcvbuf = rcvbuf           # of the server's sockets (0: the kernel's)
        self.release = trio.Event()    # lets rpc_slow go on
        self.raised = trio.Event()     # rpc_slow raised: its error frame is being sent
        self.reading = True
        self.changed = trio.Event()
        self.connections = 0
        self.closed = 0
        self.big_calls = 0
        self.slow_calls = 0
        self.laters: dict[int, Later] = {}

    def set_reading(self, on: bool) -> None:
        self.reading = on
        self.changed.set()
        self.changed = trio.Event()

    async def serve_connection(self, stream):
        self.connections += 1
        if self.rcvbuf:   # a large frame stops in the kernel while we do not read
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        try:
            await super().serve_connection(SlowReader(stream, self))
        finally:
            self.closed += 1

    def rpc_echo(self, meta, payload):
        return {"n": meta.get("n")}, bytes(payload)

    async def rpc_slow(self, meta, payload):
        self.slow_calls += 1
        await self.release.wait()
        self.raised.set()
        raise InvalidArgument("answered after the caller gave up")

    def rpc_echo_parts(self, meta, payload):
        """The payload back as parts of uneven sizes (a frame of buffers, uncopied)."""
        mv = memoryview(payload)
        cuts = [0, *meta["cuts"], len(mv)]
        return {"n": len(mv)}, [mv[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def rpc_big(self, meta, payload):
        self.big_calls += 1
        return {"len": len(payload)}

    def rpc_later(self, meta, payload):
        """Answered when the test settles it (``done``), or at once if asked."""
        later = Later()
        if meta.get("now"):
            later.done({"now": True})
        elif meta.get("now_error"):
            later.done(Fenced("ended"))
        else:
            self.laters[meta["n"]] = later
        return later


async def _poll(cond) -> None:
    while not cond():
        await trio.sleep(0.01)


async def _call_into(failed: list, pool, addr: str, method: str, timeout: float, meta=None) -> None:
    """``pool.call``, its Unavailable appended to ``failed`` instead of raised."""
    try:
        await pool.call(addr, method, meta or {}, timeout=timeout)
    except Unavailable as e:
        failed.append(e)


@pytest.fixture
async def server(nursery):
    svc = TestService()
    port = await nursery.start(svc.serve, "127.0.0.1", 0)
    return svc, f"127.0.0.1:{port}"


async def test_late_error_is_dropped_and_the_connection_stays(server):
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool:
            assert (await pool.call(addr, "echo", {"n": 0}, timeout=5))[0] == {"n": 0}
            conn = pool.conns[addr]
            failed = []
            async with trio.open_nursery() as n:   # the peer answers others meanwhile
                n.start_soon(_call_into, failed, pool, addr, "slow", 0.5)
                await _poll(lambda: conn.pending)
                await pool.call(addr, "echo", {"n": 0}, timeout=5)
            assert "timed out" in str(failed[0])
            assert not conn.pending, "the abandoned request is forgotten"
            svc.release.set()
            await svc.raised.wait()
            # the late error frame is sent before this call's answer (same connection, in order)
            for n in range(1, 4):
                meta, payload = await pool.call(addr, "echo", {"n": n}, b"x" * n, timeout=5)
                assert meta == {"n": n} and bytes(payload) == b"x" * n
            assert pool.conns[addr] is conn and not conn.closed
            assert svc.connections == 1


async def test_a_peer_silent_for_a_whole_timeout_loses_its_connection(server):
    """Nothing heard while requests waited (a partition, a peer gone): the connection is closed
    once the last request sent on it timed out, failing what else waited on it, and the next
    call connects afresh. An older one timing out while a newer one waits leaves it to the
    newer one's deadline (a replicate posted after a trim gets its whole time). A posted
    request given up on as timed out does the same."""
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool, trio.open_nursery() as n:
            assert (await pool.call(addr, "echo", {"n": 0}, timeout=5))[0] == {"n": 0}
            conn = pool.conns[addr]
            failed = []
            for i, timeout in enumerate((10, 0.3, 1.0)):
                n.start_soon(_call_into, failed, pool, addr, "slow", timeout)
                await _poll(lambda i=i: len(conn.pending) == i + 1)
            await _poll(lambda: failed)
            assert "timed out after 0.3 s" in str(failed[0]) and not conn.closed
            await _poll(lambda: len(failed) == 3)
            assert "timed out after 1 s" in str(failed[1]) and conn.closed
            assert "nothing heard" in str(failed[2])
            assert (await pool.call(addr, "echo", {"n": 1}, timeout=5))[0] == {"n": 1}
            assert pool.conns[addr] is not conn and svc.connections == 2
            conn = pool.conns[addr]
            conn.forget(conn.post("slow", {}, lambda answer: None, parts=[]), timed_out=True)
            assert conn.closed
            svc.release.set()


async def test_later_is_answered_when_settled_by_anyone(server):
    """A handler's ``Later`` is answered when settled, from whichever task settles it, or at
    once if settled before the handler returned; the connection serves others meanwhile."""
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool, trio.open_nursery() as nursery:
            got = []

            async def waiting(n):
                got.append((n, (await pool.call(addr, "later", {"n": n}, timeout=10))[0]))
            for n in range(2):
                nursery.start_soon(waiting, n)
            await _poll(lambda: len(svc.laters) == 2)
            assert (await pool.call(addr, "echo", {"n": 5}, timeout=5))[0] == {"n": 5}
            assert (await pool.call(addr, "later", {"now": True}, timeout=5))[0] == {"now": True}
            svc.laters[1].done({"k": 1})   # in another order than asked
            svc.laters[0].done({"k": 0})
            await _poll(lambda: len(got) == 2)
            assert sorted(got) == [(0, {"k": 0}), (1, {"k": 1})]
            # settled with an error (the incarnation ended): the caller gets it typed
            failed = []

            async def refused():
                with pytest.raises(Fenced, match="ended") as e:
                    await pool.call(addr, "later", {"n": 2}, timeout=10)
                failed.append(e.value)
            nursery.start_soon(refused)
            await _poll(lambda: 2 in svc.laters)
            svc.laters[2].done(Fenced("ended"))
            await _poll(lambda: failed)
            with pytest.raises(Fenced, match="ended"):
                await pool.call(addr, "later", {"now_error": True}, timeout=5)


async def test_posted_requests_answers_errors_forgotten_and_failed(server):
    """``post`` sends at once and hands the answer to its callback from the reader: a reply,
    a typed error, nothing for a forgotten request, Unavailable when the connection ends."""
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            conn = pool.conns[addr]
            got = {}

            def done(name):
                return lambda answer: got.__setitem__(name, answer)
            assert conn.post("echo", {"n": 1}, done("echo"), parts=[b"ab", b"c"]) is not None
            assert conn.post("nope", {}, done("nope"), parts=[]) is not None
            gone = conn.post("slow", {}, done("slow"), parts=[])
            conn.forget(gone)
            await _poll(lambda: len(got) == 2)
            meta, payload = got["echo"]
            assert meta == {"n": 1} and bytes(payload) == b"abc"
            assert isinstance(got["nope"], UnknownMethod)
            svc.release.set()
            await svc.raised.wait()
            assert (await pool.call(addr, "echo", {"n": 2}, timeout=5))[0] == {"n": 2}
            assert "slow" not in got and not conn.closed
            svc.release = trio.Event()
            conn.post("slow", {}, done("cut"), parts=[])
            pool.drop(addr)
            assert isinstance(got["cut"], Unavailable) and isinstance(got["cut"], KeraError)
            assert conn.post("echo", {}, done("x"), parts=[]) is None, "a closed connection posts nothing"


async def test_posted_frame_given_up_while_being_written_closes_the_connection(server):
    """A posted frame larger than the socket takes is left to a task to finish; given up on
    (a timeout) while still being written, it closes the connection: never read as a request."""
    svc, addr = server
    with trio.fail_after(30):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            conn = pool.conns[addr]
            conn.channel.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            got = []
            svc.set_reading(False)
            rid = conn.post("big", {}, got.append, parts=[b"\x07" * (8 << 20)])
            assert rid is not None and conn.writer.finishing == rid
            conn.forget(rid)
            assert conn.closed
            svc.set_reading(True)
            await _poll(lambda: svc.closed == 1)
            assert svc.big_calls == 0 and not got
            meta, _ = await pool.call(addr, "big", {}, b"y" * 1000, timeout=5)
            assert meta == {"len": 1000} and pool.conns[addr] is not conn


async def test_late_reply_is_dropped_and_the_connection_stays(server):
    """The same with a result instead of an error: a pipelined answer for nobody."""
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            conn = pool.conns[addr]
            failed = []
            async with trio.open_nursery() as n:
                n.start_soon(partial(pool.call, addr, "later", {"n": 9}, timeout=5))
                await _poll(lambda: 9 in svc.laters)
                svc.set_reading(False)   # the request sits unread past the caller's timeout,
                n.start_soon(_call_into, failed, pool, addr, "echo", 0.5, {"n": 1})
                await _poll(lambda: len(conn.pending) == 2)
                svc.laters[9].done({})   # while the peer answers another one
                await _poll(lambda: failed)
            assert "timed out" in str(failed[0])
            svc.set_reading(True)
            meta, _ = await pool.call(addr, "echo", {"n": 2}, timeout=5)
            assert meta == {"n": 2}
            assert pool.conns[addr] is conn and not conn.closed and svc.connections == 1


@pytest.mark.parametrize(("size", "pieces"), [(100, 3), (VECTOR_FROM - 200, 20), (3 * VECTOR_FROM + 7, 2000),
                                              (3 * VECTOR_FROM + 7, 20)])
async def test_frames_of_parts_small_and_vectored(server, size, pieces):
    """Requests and answers made of parts arrive whole, joined (small, or many tiny parts) or
    sent vectored."""
    svc, addr = server
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    cuts = sorted({size // 3, size // 2, size - 1} - {0})
    parts = [data[:5], memoryview(data.tobytes())[5:size // 2], *np.array_split(data[size // 2:], pieces)]
    with trio.fail_after(30):
        async with open_pool() as pool:
            meta, payload = await pool.call(addr, "echo_parts", {"cuts": cuts}, parts=parts, timeout=20)
            assert meta == {"n": size} and bytes(payload) == data.tobytes()
            assert svc.connections == 1


async def test_vectored_send_resumes_after_partial_sends():
    """More buffers than one sendmsg takes and more bytes than the kernel holds: each partial
    send resumes where it stopped, the reader gets every byte in order."""
    a, b = trio.socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    data = np.random.default_rng(7).integers(0, 256, (2 << 20) + 11, dtype=np.uint8)
    parts = [memoryview(p.tobytes()) for p in np.array_split(data, 3 * IOV_MAX)]
    parts[7:7] = [b""]        # empty parts (a close with no bytes) are skipped, not resent forever
    parts.append(b"")
    got = bytearray()
    with trio.fail_after(20), a, b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_frame, trio.SocketStream(a), parts)
            while len(got) < data.nbytes:
                got += await b.recv(1 << 16)
    assert bytes(got) == data.tobytes()


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_send_cut_mid_frame_closes_the_connection(server, how):
    svc, addr = server
    big = b"\x07" * (16 << 20)  # far more than the kernel buffers while the server does not read
    with trio.fail_after(60):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            first = pool.conns[addr]
            first.channel.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            svc.set_reading(False)
            if how == "timeout":
                with pytest.raises(Unavailable, match="timed out"):
                    await pool.call(addr, "big", {}, big, timeout=0.5)
            else:
                with trio.move_on_after(0.5) as cs:
                    await pool.call(addr, "big", {}, big)
                assert cs.cancelled_caught
            assert first.closed, "a connection with part of a frame on it is not reused"
            svc.set_reading(True)
            # the server reads what came of the frame, then the end of the stream: no request
            await _poll(lambda: svc.closed == 1)
            assert svc.big_calls == 0
            meta, payload = await pool.call(addr, "echo", {"n": 1}, b"after", timeout=5)
            assert meta == {"n": 1} and bytes(payload) == b"after"
            assert pool.conns[addr] is not first and svc.connections == 2
            meta, _ = await pool.call(addr, "big", {}, b"y" * 1000, timeout=5)
            assert meta == {"len": 1000} and svc.big_calls == 1


async def test_cancel_while_waiting_to_send_keeps_the_connection(server):
    """A call cancelled before any of its bytes went out leaves nothing on the wire."""
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            conn = pool.conns[addr]
            held, done = trio.Event(), trio.Event()

            async def other_sender():
                async with conn.writer.lock:
                    held.set()
                    await done.wait()

            async with trio.open_nursery() as n:
                n.start_soon(other_sender)
                await held.wait()
                with trio.move_on_after(0.1) as cs:
                    await pool.call(addr, "echo", {"n": 1})
                assert cs.cancelled_caught
                done.set()
            assert not conn.closed
            assert (await pool.call(addr, "echo", {"n": 2}, timeout=5))[0] == {"n": 2}
            assert pool.conns[addr] is conn


async def test_coordinator_link_moves_past_a_silent_address(server):
    """Several coordinator addresses, the first silent (its host cut off: connections are
    taken, nothing is answered): a call reaches the next within its share of the time, and
    the next call asks that one first."""
    svc, addr = server
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()   # never accepted nor read: the kernel takes the connection and the bytes
    try:
        with trio.fail_after(20):
            async with open_pool() as pool:
                link = CoordinatorLink(pool, f"127.0.0.1:{silent.getsockname()[1]},{addr}")
                t0 = trio.current_time()
                r, _ = await link.call("echo", {"n": 1}, timeout=2.0)
                assert r == {"n": 1} and trio.current_time() - t0 < 2.0 and link.leader == addr
                t0 = trio.current_time()
                await link.call("echo", {"n": 2}, timeout=2.0)
                assert trio.current_time() - t0 < 0.5, "the silent address was asked first again"
    finally:
        silent.close()


def test_advertised_addresses():
    """What a server tells others to dial: --advertise (HOST, or HOST:PORT), else the host it
    binds, never a wildcard."""
    assert advertised("10.1.2.3", 7000) == "10.1.2.3:7000"
    assert advertised("0.0.0.0", 7000) == advertised("", 7000) == "127.0.0.1:7000"
    assert advertised("0.0.0.0", 7000, "node1.example") == "node1.example:7000"
    assert advertised("10.1.2.3", 7000, "203.0.113.9:9000") == "203.0.113.9:9000"


class Standby(Service):
    """A coordinator standing by: it names ``leader``."""

    rpcs = wire.named({"slow": wire.Rpc(wire.ANYONE)})

    def __init__(self, leader: str):
        self.leader = leader

    def rpc_slow(self, meta, payload):
        raise NotLeader("stands by", leader=self.leader)


async def test_coordinator_link_never_sends_a_request_twice_where_it_may_have_landed(server, nursery):
    """The leader took the request and said nothing (its store is down, or it was cut off
    after reading it): the standby still names it, but it is not asked again within the
    call (it may have applied the request), and the call ends with its silence."""
    svc, addr = server
    port = await nursery.start(Standby(addr).serve, "127.0.0.1", 0)
    with trio.fail_after(20):
        async with open_pool() as pool:
            link = CoordinatorLink(pool, f"{addr},127.0.0.1:{port}")
            with pytest.raises(Unavailable, match="timed out"):
                await link.call("slow", {}, timeout=1.5)
    assert svc.slow_calls == 1
    svc.release.set()


# -- the same transport through TLS (kera.rpc.channel.Tls) ----------------------------------
@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory):
    from kera.security import tls
    files = tls.local_ca(str(tmp_path_factory.mktemp("ca")))
    return tls.server_context(files["cert"], files["key"]), tls.client_context(files["ca"])


@pytest.fixture
async def tls_server(nursery, tls_contexts):
    svc = TestService(rcvbuf=0)
    svc.tls = tls_contexts[0]
    port = await nursery.start(svc.serve, "127.0.0.1", 0)
    return svc, f"127.0.0.1:{port}", Credentials(tls=tls_contexts[1])


@pytest.mark.parametrize(("size", "pieces"), [(100, 3), (3 * VECTOR_FROM + 7, 2000), (40 << 20, 20)])
async def test_frames_over_tls_arrive_whole(tls_server, size, pieces):
    """Frames of parts, tiny or of many MiB (more than a receive takes, more than a piece
    encrypts, more than the kernel holds), cross TLS whole both ways, pipelined with
    others on the same connection."""
    svc, addr, creds = tls_server
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    cuts = sorted({size // 3, size // 2, size - 1} - {0})
    parts = [data[:5], memoryview(data.tobytes())[5:size // 2], *np.array_split(data[size // 2:], pieces)]
    with trio.fail_after(60):
        async with open_pool(credentials=creds) as pool, trio.open_nursery() as nursery:
            async def small(n):
                assert (await pool.call(addr, "echo", {"n": n}, b"x" * n, timeout=30)) == ({"n": n}, b"x" * n)
            for n in range(20):
                nursery.start_soon(small, n)
            meta, payload = await pool.call(addr, "echo_parts", {"cuts": cuts}, parts=parts, timeout=50)
            assert meta == {"n": size} and bytes(payload) == data.tobytes()
    assert svc.connections == 1


async def _tls_pair(tls_contexts) -> tuple[Tls, Tls]:
    """A server and a client ``Tls`` over a socket pair, handshaken (the caller closes them)."""
    a, b = trio.socket.socketpair()
    server = Tls(trio.SocketStream(a), tls_contexts[0], server_side=True)
    client = Tls(trio.SocketStream(b), tls_contexts[1], server_side=False, server_hostname="localhost")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handshake)
            nursery.start_soon(client.handshake)
    return server, client


async def test_tls_seals_a_frame_of_chunks_a_piece_at_a_time(tls_contexts):
    """A frame of 16 KB chunks (a replicate's, a produce's) leaves as one ciphertext buffer,
    one system call, per ``TLS_PIECE`` of plaintext, not one per chunk, and decrypts to the
    frame's bytes in order."""
    server, client = await _tls_pair(tls_contexts)
    parts = [memoryview(bytes([i]) * (TLS_RECORD + 184)) for i in range(64)]
    parts[10:10] = [memoryview(b"small") for _ in range(3)]
    sealed = list(client.sealing(parts))
    total = sum(map(len, parts))
    assert len(sealed) <= -(-total // TLS_PIECE) + 1
    server.incoming.write(b"".join(sealed))
    got = b""
    while (data := server._open()) is not None:
        got += data
    assert got == b"".join(parts)
    for t in (server, client):
        t.socket.close()


async def test_posted_and_later_answers_over_tls(tls_server):
    """A posted request and a ``Later`` settled from another task are written from where they
    are made, encrypted, with no task: answered in order of settling, the connection kept."""
    svc, addr, creds = tls_server
    with trio.fail_after(20):
        async with open_pool(credentials=creds) as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            conn = pool.conns[addr]
            got = {}
            assert conn.post("echo", {"n": 1}, lambda a: got.__setitem__("echo", a),
                             parts=[b"ab", b"c" * 70_000]) is not None
            assert conn.post("later", {"n": 7}, lambda a: got.__setitem__("later", a), parts=[]) is not None
            await _poll(lambda: "echo" in got and 7 in svc.laters)
            assert got["echo"][0] == {"n": 1} and bytes(got["echo"][1]) == b"ab" + b"c" * 70_000
            svc.laters[7].done({"k": 7})
            await _poll(lambda: "later" in got)
            assert got["later"][0] == {"k": 7} and not conn.closed


async def test_tls_connections_end_cleanly_and_refuse_the_clear(tls_server):
    """A closed TLS connection is seen closed by the other end (close_notify), the next call
    opens a new one; a plaintext client is told the listener takes TLS only."""
    svc, addr, creds = tls_server
    with trio.fail_after(20):
        async with open_pool(credentials=creds) as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            pool.drop(addr)
            await _poll(lambda: svc.closed == 1)
            assert (await pool.call(addr, "echo", {"n": 1}, timeout=5))[0] == {"n": 1}
            assert svc.connections == 2
        async with open_pool() as clear:
            with pytest.raises(Unavailable, match="TLS only"):
                await clear.call(addr, "echo", {"n": 2}, timeout=5)


class _CountingReads:
    """An ``SSLObject`` whose reads that found nothing to open are counted."""

    def __init__(self, obj):
        self.obj, self.empty = obj, 0

    def read(self, n, buf):
        try:
            return self.obj.read(n, buf)
        except ssl.SSLWantReadError:
            self.empty += 1
            raise

    def __getattr__(self, name):
        return getattr(self.obj, name)


async def test_tls_opens_records_cut_anywhere_without_reading_past_them(tls_contexts):
    """Ciphertext arriving cut anywhere (inside a record's header, inside its body, whole
    records) opens to the frame's bytes in order, then the peer's close_notify to b"";
    a receive of whole records reads no further than them (an empty read raises, which
    costs as much as opening a small record)."""
    server, client = await _tls_pair(tls_contexts)
    server.obj = counting = _CountingReads(server.obj)
    plain = np.random.default_rng(7).integers(0, 256, 5 * TLS_RECORD + 999, dtype=np.uint8).tobytes()
    sealed = b"".join(client.sealing([memoryview(plain)]))
    server.incoming.write(sealed)
    got = server._open()
    assert got == plain and counting.empty == 0 and server._open() is None and counting.empty == 0
    sealed = b"".join(client.sealing([memoryview(plain)]))
    got, at = b"", 0
    for cut in [1, 3, 2, 100, TLS_RECORD, 7, TLS_RECORD + 30, 1 << 20]:
        server.incoming.write(sealed[at:at + cut])
        at += cut
        while (data := server._open()) is not None:
            got += data
    assert got == plain
    try:
        client.obj.unwrap()
    except ssl.SSLWantReadError:
        pass
    server.incoming.write(client.out.read())
    assert server._open() == b"" and server.ended
    for t in (server, client):
        t.socket.close()
