"""RPC hygiene against a real server on 127.0.0.1: a late reply or error for a request
nobody waits for any more is dropped (the connection stays), and a send cut in the
middle of a frame closes its connection (the server never reads the rest as a request)."""

from __future__ import annotations

import socket

import pytest
import trio

from kera.errors import InvalidArgument, Unavailable
from kera.rpc import Service, open_pool


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

    async def aclose(self):
        await self.stream.aclose()


class TestService(Service):
    __test__ = False

    def __init__(self):
        self.release = trio.Event()    # lets rpc_slow go on
        self.raised = trio.Event()     # rpc_slow raised: its error frame is being sent
        self.reading = True
        self.changed = trio.Event()
        self.connections = 0
        self.closed = 0
        self.big_calls = 0

    def set_reading(self, on: bool) -> None:
        self.reading = on
        self.changed.set()
        self.changed = trio.Event()

    async def serve_connection(self, stream):
        self.connections += 1
        # a small receive buffer: a large frame stops in the kernel while we do not read
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            await super().serve_connection(SlowReader(stream, self))
        finally:
            self.closed += 1

    def rpc_echo(self, meta, payload):
        return {"n": meta.get("n")}, bytes(payload)

    async def rpc_slow(self, meta, payload):
        await self.release.wait()
        self.raised.set()
        raise InvalidArgument("answered after the caller gave up")

    def rpc_big(self, meta, payload):
        self.big_calls += 1
        return {"len": len(payload)}


async def _poll(cond) -> None:
    while not cond():
        await trio.sleep(0.01)


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
            with pytest.raises(Unavailable, match="timed out"):
                await pool.call(addr, "slow", {}, timeout=0.2)
            assert not conn.pending, "the abandoned request is forgotten"
            svc.release.set()
            await svc.raised.wait()
            # the late error frame is sent before this call's answer (same connection, in order)
            for n in range(1, 4):
                meta, payload = await pool.call(addr, "echo", {"n": n}, b"x" * n, timeout=5)
                assert meta == {"n": n} and bytes(payload) == b"x" * n
            assert pool.conns[addr] is conn and not conn.closed
            assert svc.connections == 1


async def test_late_reply_is_dropped_and_the_connection_stays(server):
    """The same with a result instead of an error: a pipelined answer for nobody."""
    svc, addr = server
    with trio.fail_after(20):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            conn = pool.conns[addr]
            svc.set_reading(False)   # the request sits unread past the caller's timeout
            with pytest.raises(Unavailable, match="timed out"):
                await pool.call(addr, "echo", {"n": 1}, timeout=0.2)
            svc.set_reading(True)
            meta, _ = await pool.call(addr, "echo", {"n": 2}, timeout=5)
            assert meta == {"n": 2}
            assert pool.conns[addr] is conn and not conn.closed and svc.connections == 1


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_send_cut_mid_frame_closes_the_connection(server, how):
    svc, addr = server
    big = b"\x07" * (16 << 20)  # far more than the kernel buffers while the server does not read
    with trio.fail_after(60):
        async with open_pool() as pool:
            await pool.call(addr, "echo", {"n": 0}, timeout=5)
            first = pool.conns[addr]
            first.stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
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
                async with conn.send_lock:
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
