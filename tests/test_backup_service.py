"""The backup as a real process on 127.0.0.1: replicate, list, read, kill -9, restart.

Every test is bounded (pytest-timeout and trio.fail_after). Waiting is on
events (a process line, an RPC reply); where the backup's background flusher
or heartbeats must act first, a bounded poll stands in for the event. The
membership test runs a real coordinator in the test's own trio loop.
"""

from __future__ import annotations

import inspect
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import trio

from kera import chunk
from kera.backup import segment_file as sf
from kera.backup.membership import load_id
from kera.backup.replica import index_runs
from kera.coordinator.service import Coordinator
from kera.errors import BackupError, ChecksumError, Fenced, InvalidArgument
from kera.recovery import index_chunk
from kera.recovery.plan import Listing
from kera.wire.columns import INDEX_COLUMNS

from .conftest import free_port, stream_meta
from .damage import flip_bits
from .members import SECRET, open_members, secret_file

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^backup (\S+) listening on (\S+):(\d+)$")


# -- a backup process -------------------------------------------------------------


class Backup:
    def __init__(self, directory, logdir, args=(), preexec_fn=None):
        self.dir, self.logdir, self.args, self.preexec_fn = str(directory), logdir, list(args), preexec_fn
        self.proc = None
        self.starts = 0

    def start(self) -> Backup:
        self.starts += 1
        self.log = os.path.join(self.logdir, f"backup-{os.path.basename(self.dir)}-{self.starts}.log")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kera.backup.main", "--dir", self.dir, "--port", "0",
                 "--flush-interval", "0.02", "--cluster-secret-file",
                 secret_file(os.path.dirname(self.logdir)),
                 *self.args],
                stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=env, preexec_fn=self.preexec_fn)
        line = _readline(self.proc, 20)
        m = LINE.match(line)
        assert m, f"unexpected first line {line!r}"
        self.id_text, self.addr = m[1], f"127.0.0.1:{m[3]}"
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def term(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(10)

    def restart(self) -> Backup:
        if self.proc.poll() is None:
            self.kill()
        return self.start()

    def logs(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def seg(self, broker, vlog, vseg) -> str:
        return os.path.join(self.dir, "segments", sf.file_name(broker, vlog, vseg))


def _readline(proc, timeout: float) -> str:
    deadline, buf, fd = time.monotonic() + timeout, b"", proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            raise AssertionError(f"backup did not report listening (rc={proc.poll()}): {buf!r}")
        if select.select([fd], [], [], min(left, 0.5))[0]:
            data = os.read(fd, 4096)
            if not data and proc.poll() is not None:
                continue
            buf += data
    return buf.split(b"\n", 1)[0].decode()


@pytest.fixture
def backups(tmp_path):
    made = []
    logdir = tmp_path / "logs"
    logdir.mkdir()

    def make(name="data", args=(), preexec_fn=None, directory=None):
        b = Backup(directory or tmp_path / name, str(logdir), args, preexec_fn)
        made.append(b)
        return b.start()

    yield make
    for b in made:
        if b.proc and b.proc.poll() is None:
            b.kill()
        if b.proc and b.proc.stdout:
            b.proc.stdout.close()
    for name in sorted(os.listdir(logdir)):  # shown by pytest when a test fails
        with open(logdir / name, errors="replace") as f:
            print(f"---- {name}\n{f.read()[-4000:]}")


# -- helpers ---------------------------------------------------------------------------


def chunks_for(n, seq0=0, records=5, stream=3):
    return [chunk.build(stream, i % 4, 11, seq0 + i, [b"r%d-%d" % (seq0 + i, j) * (j + 1) for j in range(records)])
            for i in range(n)]


async def replicate(pool, addr, vseg, offset, payload=b"", close=False, broker=1, epoch=1, vlog=0):
    r, _ = await pool.call(addr, "replicate", {"broker": broker, "epoch": epoch, "vlog": vlog, "vseg": vseg,
                                               "offset": offset, "close": close}, payload)
    return r["length"]


async def send_all(pool, addr, vseg, chunks, per_rpc=3, offset0=0, **kw):
    """Replicate chunks in several RPCs (from ``offset0``); returns the replica's length."""
    off = offset0
    for i in range(0, len(chunks), per_rpc):
        got = await replicate(pool, addr, vseg, off, b"".join(chunks[i:i + per_rpc]), **kw)
        assert got == off + sum(map(len, chunks[i:i + per_rpc]))
        off = got
    return off


async def read_all(pool, addr, vseg, broker=1, vlog=0, max_bytes=700):
    """Every served byte of a replica, and where the backup reported corruption."""
    data, corrupt, off = b"", [], 0
    for _ in range(10_000):
        m, p = await pool.call(addr, "read", {"broker": broker, "vlog": vlog, "vseg": vseg,
                                              "offset": off, "max_bytes": max_bytes})
        assert m["next"] > off or m["end"]
        if len(p):
            chunk.scan(p)  # whole, valid chunks only
            assert len(p) <= max_bytes or len(chunk.scan(p)) == 1
        data += bytes(p)
        if "corrupt_at" in m:
            corrupt.append(m["corrupt_at"])
        off = m["next"]
        if m["end"]:
            return data, corrupt, m
    raise AssertionError("read did not end")


async def segments(pool, addr):
    r, _ = await pool.call(addr, "list", {})
    return {(s["broker"], s["vlog"], s["vseg"]): s for s in r["segments"]}


async def stats(pool, addr):
    return (await pool.call(addr, "stats", {}))[0]


async def until(pred, what, timeout=5.0):
    """Poll a predicate, plain or async: the backup's flusher and its heartbeats, and the
    coordinator's failure detector, act on their own clocks."""
    with trio.move_on_after(timeout):
        while True:
            r = pred()
            if inspect.isawaitable(r):
                r = await r
            if r:
                return
            await trio.sleep(0.01)
    raise AssertionError(f"not within {timeout} s: {what}")


# -- tests -------------------------------------------------------------------------------


async def test_replicate_list_read_survive_kill9(backups):
    bk = backups(args=["--fsync", "always"])
    a, b = chunks_for(7), chunks_for(4, seq0=100, records=40)
    with trio.fail_after(20):
        async with open_members() as pool:
            la = await send_all(pool, bk.addr, 0, a)
            lb = await send_all(pool, bk.addr, 1, b, per_rpc=1, vlog=2)
            assert await replicate(pool, bk.addr, 1, lb, close=True, vlog=2) == lb
            # a resend of what is held is acknowledged, changes nothing
            assert await replicate(pool, bk.addr, 0, 0, b"".join(a[:3])) == sum(map(len, a[:3]))
            # a gap or a partial overlap is refused, saying where the replica ends
            with pytest.raises(BackupError, match=f"length={la}"):
                await replicate(pool, bk.addr, 0, la + 8, a[0])
            with pytest.raises(BackupError, match=f"length={la}"):
                await replicate(pool, bk.addr, 0, la - len(a[-1]), a[-1] + a[0])
            before = await segments(pool, bk.addr)
            assert before[(1, 0, 0)]["length"] == la and before[(1, 0, 0)]["chunks"] == 7
            assert before[(1, 2, 1)]["closed"] and not before[(1, 0, 0)]["closed"]
            assert (await read_all(pool, bk.addr, 0))[:2] == (b"".join(a), [])
            assert (await read_all(pool, bk.addr, 1, vlog=2, max_bytes=1))[:2] == (b"".join(b), [])
            st = await stats(pool, bk.addr)
            assert st["chunks"] == 11 and st["bytes_flushed"] == st["bytes_received"] == la + lb

            bk.restart()  # SIGKILL, then start on the same directory
            after = await segments(pool, bk.addr)
            for k in before:
                for f in ("length", "chunks", "closed", "corrupt", "checksum"):
                    assert after[k][f] == before[k][f], (k, f)
            assert (await read_all(pool, bk.addr, 0))[:2] == (b"".join(a), [])
            assert (await read_all(pool, bk.addr, 1, vlog=2))[:2] == (b"".join(b), [])
            # the open replica keeps growing after the restart; the closed one refuses appends
            c = chunks_for(2, seq0=50)
            assert await replicate(pool, bk.addr, 0, la, b"".join(c)) == la + len(c[0]) + len(c[1])
            with pytest.raises(BackupError, match="closed"):
                await replicate(pool, bk.addr, 1, lb, c[0], vlog=2)


async def test_write_mode_acks_survive_kill9(backups):
    """The default mode answers once the bytes are in the file: a killed process keeps them."""
    bk = backups(args=["--flush-interval", "30"])  # only a replicate's own flush writes
    a = chunks_for(6)
    with trio.fail_after(20):
        async with open_members() as pool:
            la = await send_all(pool, bk.addr, 0, a)
            bk.restart()  # SIGKILL right after the acks
            assert (await read_all(pool, bk.addr, 0))[:2] == (b"".join(a), [])
            assert (await segments(pool, bk.addr))[(1, 0, 0)]["length"] == la


async def test_periodic_mode_sigterm_flushes(backups):
    bk = backups(args=["--fsync", "periodic", "--fsync-interval", "30", "--flush-interval", "30"])  # only SIGTERM flushes
    a = chunks_for(9)
    with trio.fail_after(20):
        async with open_members() as pool:
            la = await send_all(pool, bk.addr, 4, a)
            assert await replicate(pool, bk.addr, 4, la, close=True) == la
            st = await stats(pool, bk.addr)
            assert st["bytes_received"] == la
            assert bk.term() == 0
            bk.start()
            seg = (await segments(pool, bk.addr))[(1, 0, 4)]
            assert (seg["length"], seg["chunks"], seg["closed"]) == (la, 9, True)
            assert (await read_all(pool, bk.addr, 4))[0] == b"".join(a)


async def test_bit_flip_on_disk_is_reported_never_served(backups):
    bk = backups(args=["--fsync", "always"])
    a, b = chunks_for(6), chunks_for(5, seq0=10)
    starts_a = [sum(map(len, a[:i])) for i in range(len(a))]
    starts_b = [sum(map(len, b[:i])) for i in range(len(b))]
    with trio.fail_after(20):
        async with open_members() as pool:
            la = await send_all(pool, bk.addr, 0, a)
            lb = await send_all(pool, bk.addr, 1, b)
            for vseg in (2, 3):   # closed: one intact, one with a flipped body bit
                await replicate(pool, bk.addr, vseg, await send_all(pool, bk.addr, vseg, a), close=True)
            bk.kill()
            # a body bit of chunk 2 of vseg 0; a header bit of chunk 3 of vseg 1
            flip_bits(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts_a[2] + chunk.HEADER_SIZE + 17, 1 << 3)
            flip_bits(bk.seg(1, 0, 1), sf.FILE_HEADER_SIZE + starts_b[3] + 40, 1 << 6)
            flip_bits(bk.seg(1, 0, 3), sf.FILE_HEADER_SIZE + starts_a[1] + chunk.HEADER_SIZE + 5, 1 << 2)
            bk.start()
            segs = await segments(pool, bk.addr)
            # a recovery's listing: the closed, intact copy as a row of columns, the others as maps
            meta, payload = await pool.call(bk.addr, "list", {"broker": 2, "columns": True})
            assert Listing.of(meta, payload).plain.shape == (0, 5) and meta["segments"] == []   # none
            meta, payload = await pool.call(bk.addr, "list", {"broker": 1, "columns": True})
            got = Listing.of(meta, payload)
            assert [s["vseg"] for s in got.segments] == [0, 1, 3] and got.segments == [segs[(1, 0, v)] for v in (0, 1, 3)]
            s2 = segs[(1, 0, 2)]
            assert got.plain.tolist() == [[0, 2, s2["length"], 6, s2["checksum"]]] and s2["length"] == la
            for bad in ({"columns": True}, {"broker": -1, "columns": True}, {"broker": 1, "columns": 1}):
                with pytest.raises(InvalidArgument):   # columns of one broker's copies, asked as a bool
                    await pool.call(bk.addr, "list", bad)
            assert await segments(pool, bk.addr) == segs   # nothing changed
            s0, s1 = segs[(1, 0, 0)], segs[(1, 0, 1)]
            assert s0["length"] == la and s0["chunks"] == 5
            assert [(c["offset"], c["length"]) for c in s0["corrupt"]] == [(starts_a[2], len(a[2]))]
            assert s1["length"] == lb and s1["chunks"] == 3
            assert [(c["offset"], c["length"]) for c in s1["corrupt"]] == [(starts_b[3], lb - starts_b[3])]
            data, corrupt, _ = await read_all(pool, bk.addr, 0)
            assert data == b"".join(a[:2] + a[3:]) and corrupt == [starts_a[2]]
            data, corrupt, _ = await read_all(pool, bk.addr, 1)
            assert data == b"".join(b[:3]) and corrupt == [starts_b[3]]
            assert "corrupt at offset" in bk.logs()
            # a replica whose rest cannot be located takes no more appends (they could not be found)
            with pytest.raises(BackupError, match="damaged"):
                await replicate(pool, bk.addr, 1, lb, b[0])


async def test_corruption_found_when_reading_back_from_file(backups):
    bk = backups(args=["--fsync", "always"])
    a = chunks_for(4)
    starts = [sum(map(len, a[:i])) for i in range(len(a))]
    with trio.fail_after(20):
        async with open_members() as pool:
            la = await send_all(pool, bk.addr, 0, a)
            await replicate(pool, bk.addr, 0, la, close=True)
            # closed and fsynced: memory released, reads come from the file; rot a chunk now
            await until(lambda: _memory_zero(pool, bk.addr), "memory released")
            flip_bits(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts[1] + chunk.HEADER_SIZE + 3)
            data, corrupt, _ = await read_all(pool, bk.addr, 0)
            assert data == b"".join([a[0], a[2], a[3]]) and corrupt == [starts[1]]
            seg = (await segments(pool, bk.addr))[(1, 0, 0)]
            assert seg["chunks"] == 3 and seg["corrupt"][0]["offset"] == starts[1]


async def test_the_scrubber_finds_rot_no_one_reads_and_counts_it(backups):
    """A chunk rots in a file no one reads: the scrubber reads every written chunk back at
    its rate and finds it, marks it corrupt (listed, never served) and counts it in
    ``damage`` (what heartbeats carry to the brokers); the other chunks, and the other
    replica, are served as before, and the next pass finds nothing new."""
    bk = backups(args=["--fsync", "always", "--scrub-rate", str(64 << 20), "--scrub-every", "0.2"])
    a, b = chunks_for(6), chunks_for(3, seq0=10)
    starts = [sum(map(len, a[:i])) for i in range(len(a))]
    with trio.fail_after(30):
        async with open_members() as pool:
            la = await send_all(pool, bk.addr, 0, a)
            await replicate(pool, bk.addr, 0, la, close=True)
            await send_all(pool, bk.addr, 1, b)   # left open: its written part is scrubbed too
            passes = (await stats(pool, bk.addr))["scrub_passes"]
            await until(lambda: _passes_past(pool, bk.addr, passes), "a scrub pass", timeout=10)
            assert (await stats(pool, bk.addr))["damage"] == 0
            flip_bits(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts[4] + chunk.HEADER_SIZE + 5)
            await until(lambda: _damage(pool, bk.addr, 1), "the scrubber to find the rotten chunk", timeout=10)
            seg = (await segments(pool, bk.addr))[(1, 0, 0)]
            assert [(c["offset"], c["length"]) for c in seg["corrupt"]] == [(starts[4], len(a[4]))]
            data, corrupt, _ = await read_all(pool, bk.addr, 0)
            assert data == b"".join(a[:4] + a[5:]) and corrupt == [starts[4]]
            assert (await read_all(pool, bk.addr, 1))[0] == b"".join(b)
            st = await stats(pool, bk.addr)
            await until(lambda: _passes_past(pool, bk.addr, st["scrub_passes"] + 1), "two more passes",
                        timeout=10)
            st = await stats(pool, bk.addr)
            assert st["damage"] == 1 and st["scrubbed_bytes"] > 3 * (la + sum(map(len, b))), st
    assert "failed verification" in bk.logs()


async def _passes_past(pool, addr, n) -> bool:
    return (await stats(pool, addr))["scrub_passes"] > n


async def _damage(pool, addr, n) -> bool:
    return (await stats(pool, addr))["damage"] >= n


async def _memory_zero(pool, addr):
    return (await stats(pool, addr))["memory_bytes"] == 0


async def test_torn_tail_cut_on_restart(backups):
    bk = backups(args=["--fsync", "always"])
    a = chunks_for(5)
    starts = [sum(map(len, a[:i])) for i in range(len(a))]
    with trio.fail_after(20):
        async with open_members() as pool:
            await send_all(pool, bk.addr, 0, a, per_rpc=2)
            bk.kill()
            os.truncate(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts[4] + chunk.HEADER_SIZE + 7)
            bk.start()
            seg = (await segments(pool, bk.addr))[(1, 0, 0)]
            assert (seg["length"], seg["chunks"], seg["corrupt"]) == (starts[4], 4, [])
            assert os.path.getsize(bk.seg(1, 0, 0)) == sf.FILE_HEADER_SIZE + starts[4]
            assert "torn tail" in bk.logs()
            assert (await read_all(pool, bk.addr, 0))[0] == b"".join(a[:4])
            # the broker resends what was cut, from the length it is told
            with pytest.raises(BackupError, match=f"length={starts[4]}"):
                await replicate(pool, bk.addr, 0, starts[4] + len(a[4]), a[4])
            assert await replicate(pool, bk.addr, 0, starts[4], a[4]) == starts[4] + len(a[4])


async def test_bad_input_refused_and_others_still_served(backups):
    bk = backups()
    a = chunks_for(3)
    bad = bytearray(a[1])
    bad[chunk.HEADER_SIZE + 5] ^= 0x40
    with trio.fail_after(20):
        async with open_members() as p1, open_members() as p2:
            la = await replicate(p1, bk.addr, 0, 0, a[0])
            with pytest.raises(ChecksumError):
                await replicate(p1, bk.addr, 0, la, a[1] + bytes(bad))
            with pytest.raises(InvalidArgument):
                await replicate(p1, bk.addr, 0, la, a[1][:-8])
            with pytest.raises(InvalidArgument):
                await replicate(p1, bk.addr, 0, la, b"\x00" * 200)
            with pytest.raises(InvalidArgument):
                await p1.call(bk.addr, "replicate", {"broker": "x", "vlog": 0, "vseg": 0, "offset": 0})
            with pytest.raises(Fenced):
                await replicate(p1, bk.addr, 0, la, a[1], epoch=0)
            # garbage on a raw socket: that connection is dropped, nobody else notices
            s = await trio.open_tcp_stream("127.0.0.1", int(bk.addr.rsplit(":", 1)[1]))
            await s.send_all(b"GET / HTTP/1.0\r\n\r\n" * 4)
            with trio.fail_after(5):
                while await s.receive_some(1 << 16):
                    pass
            await s.aclose()
            seg = (await segments(p2, bk.addr))[(1, 0, 0)]
            assert (seg["length"], seg["chunks"]) == (la, 1)  # nothing stored by the bad calls
            assert await replicate(p2, bk.addr, 0, la, a[1]) == la + len(a[1])
            assert await replicate(p1, bk.addr, 0, la + len(a[1]), a[2]) == sum(map(len, a))
            st = await stats(p2, bk.addr)
            # refused by the backup (4), or by the wire table before it (a field's type: 1)
            assert st["errors"] >= 4 and st["door"]["requests_refused"] >= 1 and st["chunks"] == 3
            assert bk.proc.poll() is None


async def test_a_batch_is_served_entry_by_entry_and_a_malformed_one_stores_nothing(backups):
    """One replicate carrying several vseg copies (how a broker sends all its vlogs' copies for
    a backup): a bad entry gets its own typed error and stores nothing, the others are stored,
    on disk (write mode) and answered together; a malformed batch is refused whole."""
    bk = backups()
    a = chunks_for(4)
    bad = bytearray(a[3])
    bad[chunk.HEADER_SIZE + 5] ^= 0x40
    ep = {"broker": 1, "epoch": 1}
    with trio.fail_after(20):
        async with open_members() as pool:
            la = await replicate(pool, bk.addr, 0, 0, a[0])
            entries = [[0, 0, la, False, len(a[1])],      # continues vlog 0's vseg 0
                       [0, 1, 100, False, len(a[2])],     # a gap: no copy of vseg 1 here
                       [2, 0, 0, True, len(a[2])],        # a new copy, closed at once
                       [3, 0, 0, False, len(bad)],        # a bad checksum
                       [4, 0, 0, False, 0]]               # nothing: no copy, length 0
            r, _ = await pool.call(bk.addr, "replicate", {**ep, "entries": entries},
                                   a[1] + a[2] + a[2] + bytes(bad), timeout=5)
            ok, gap, closed, corrupt, empty = r["results"]
            assert ok == la + len(a[1]) and closed == len(a[2]) and empty == 0
            assert gap["code"] == "backup" and gap["length"] == 0
            assert corrupt["code"] == "checksum"
            async def held():
                return {k: (v["length"], v["chunks"], v["closed"])
                        for k, v in (await segments(pool, bk.addr)).items()}

            stored = await held()
            assert stored == {(1, 0, 0): (ok, 2, False), (1, 2, 0): (closed, 1, True)}
            assert (await read_all(pool, bk.addr, 0))[:2] == (a[0] + a[1], [])
            # malformed: refused whole, nothing stored (lengths not adding up, bad fields, too many)
            for meta, payload in [({**ep, "entries": [[0, 0, ok, False, len(a[3])]]}, a[3] + b"x"),
                                  ({**ep, "entries": [[0, 0, ok, 0, len(a[3])]]}, a[3]),
                                  ({**ep, "entries": [[0, 0, ok, False]]}, a[3]),
                                  ({**ep, "entries": []}, b""),
                                  ({**ep, "entries": [[5, 0, 0, False, 0]] * 1025}, b""),
                                  ({"broker": -1, "epoch": 1, "entries": [[5, 0, 0, False, 0]]},
                                   b"")]:
                with pytest.raises(InvalidArgument):
                    await pool.call(bk.addr, "replicate", {**meta}, payload, timeout=5)
            assert await held() == stored
            # a fenced epoch: every entry says so, nothing stored
            r, _ = await pool.call(bk.addr, "replicate", {"broker": 1, "epoch": 0, "entries": [
                [0, 0, ok, False, len(a[3])], [6, 0, 0, False, len(a[3])]]}, a[3] + a[3], timeout=5)
            assert [x["code"] for x in r["results"]] == ["fenced", "fenced"]
            assert await held() == stored
            st = await stats(pool, bk.addr)
            assert st["chunks"] == 3 and st["replicate_entries"] == 1 + 5 + 2
            # what was acknowledged in the batch was written before the answer
            bk.restart()
            assert (await read_all(pool, bk.addr, 0))[:2] == (a[0] + a[1], [])
            assert (await read_all(pool, bk.addr, 0, vlog=2))[:2] == (a[2], [])


async def test_max_bytes_refuses_up_front(backups):
    a = chunks_for(12)
    size = len(a[0])
    limit = sf.FILE_HEADER_SIZE + 5 * size + size // 2
    bk = backups(args=["--max-bytes", str(limit)])
    with trio.fail_after(20):
        async with open_members() as pool:
            off = 0
            for c in a[:5]:
                off = await replicate(pool, bk.addr, 0, off, c)
            with pytest.raises(BackupError, match="max-bytes"):
                await replicate(pool, bk.addr, 0, off, a[5])
            with pytest.raises(BackupError, match="max-bytes"):
                await replicate(pool, bk.addr, 7, 0, a[5])  # a new segment neither
            seg = (await segments(pool, bk.addr))[(1, 0, 0)]
            assert (seg["length"], seg["chunks"]) == (off, 5)
            assert (1, 0, 7) not in await segments(pool, bk.addr)
            assert (await read_all(pool, bk.addr, 0))[0] == b"".join(a[:5])
            # releasing a vseg (its vlog's floor passes it) frees its space; bad trims are
            # refused and change nothing
            for bad in ({"broker": 1, "vlog": 0}, {"broker": 1, "vlog": 0, "floor": -1},
                        {"broker": 1, "vlog": "0", "floor": 1}, {"vlog": 0, "floor": 1}):
                with pytest.raises(InvalidArgument):
                    await pool.call(bk.addr, "trim", bad)
            assert os.path.exists(bk.seg(1, 0, 0))
            r, _ = await pool.call(bk.addr, "trim", {"broker": 1, "vlog": 0, "floor": 1})
            assert r["bytes"] > 0 and not os.path.exists(bk.seg(1, 0, 0))
            r, _ = await pool.call(bk.addr, "trim", {"broker": 1, "vlog": 0, "floor": 1})
            assert r == {"bytes": 0}
            assert await replicate(pool, bk.addr, 7, 0, a[5]) == size


def _limit_file_size(limit):
    def fn():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return fn


@pytest.mark.parametrize("mode", ["always", "write"])  # write: small rounds on the event loop
async def test_write_error_fails_the_replicate(backups, mode):
    a = chunks_for(30)
    limit = sf.FILE_HEADER_SIZE + 10 * len(a[0]) + 10
    bk = backups(args=["--fsync", mode], preexec_fn=_limit_file_size(limit))
    with trio.fail_after(20):
        async with open_members() as pool:
            off, acked = 0, []
            with pytest.raises(BackupError, match="File too large"):
                for c in a:
                    off = await replicate(pool, bk.addr, 0, off, c)
                    acked.append(c)
            assert len(acked) == 10
            with pytest.raises(BackupError, match="File too large"):  # remembered
                await replicate(pool, bk.addr, 0, 0, a[0])
            with pytest.raises(BackupError, match="disk failing"):  # no new segment meanwhile
                await replicate(pool, bk.addr, 1, 0, a[0])
            assert (await stats(pool, bk.addr))["write_errors"] >= 1
            # every acknowledged chunk is on disk
            bk.kill()
            bk.preexec_fn = None
            bk.start()
            assert (await read_all(pool, bk.addr, 0))[0] == b"".join(acked)


def _chattr(flag, *paths) -> bool:
    r = subprocess.run(["chattr", flag, *paths], capture_output=True)
    return r.returncode == 0


async def test_read_only_storage_periodic_mode(backups):
    """chattr +i: even root cannot create or write there (chmod 0555 does not stop root)."""
    bk = backups(args=["--fsync", "periodic"])
    a = chunks_for(4)
    segdir = os.path.join(bk.dir, "segments")
    with trio.fail_after(25):
        async with open_members() as pool:
            off = await replicate(pool, bk.addr, 0, 0, a[0])  # creates the file
            path = bk.seg(1, 0, 0)
            if not _chattr("+i", segdir, path):
                pytest.skip("chattr +i is not supported here")
            try:
                with pytest.raises(BackupError, match="cannot create|disk failing"):  # the flusher may see it first
                    await replicate(pool, bk.addr, 1, 0, a[0])
                # accepted in memory; the flusher's write fails; the NEXT replicate is refused
                kept = a[:1]
                try:
                    off = await replicate(pool, bk.addr, 0, off, a[1])
                    kept = a[:2]
                except BackupError:  # a[0]'s flush may have failed already
                    pass

                async def refused():
                    try:
                        await replicate(pool, bk.addr, 0, 0, a[0])  # a resend: refused once failing
                    except BackupError as e:
                        return "failed" in str(e)
                    return False

                await until(refused, "write failure reported")
                with pytest.raises(BackupError):
                    await replicate(pool, bk.addr, 2, 0, a[0])
                assert (await stats(pool, bk.addr))["disk_error"]
            finally:
                _chattr("-i", segdir, path)

            async def accepted():
                try:
                    await replicate(pool, bk.addr, 0, 0, a[0])
                    return True
                except BackupError:
                    return False

            await until(accepted, "writes work again")  # the flusher retried, the error cleared
            assert await replicate(pool, bk.addr, 2, 0, a[0]) == len(a[0])
            assert bk.term(signal.SIGINT) == 0
            bk.start()
            assert (await read_all(pool, bk.addr, 0))[0] == b"".join(kept)


async def test_real_full_disk_on_tmpfs(backups, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.decode().strip()}")
    try:
        bk = backups(directory=mnt / "data", args=["--fsync", "always"])
        a = chunks_for(200, records=30)
        with trio.fail_after(20):
            async with open_members() as pool:
                off, acked = 0, []
                with pytest.raises(BackupError, match="No space left"):
                    for c in a:
                        off = await replicate(pool, bk.addr, 0, off, c)
                        acked.append(c)
                assert acked
                bk.kill()
                bk.start()
                data = (await read_all(pool, bk.addr, 0))[0]
                assert data[:len(b"".join(acked))] == b"".join(acked)
                bk.kill()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _backup_member(coord: Coordinator):
    """The one backup the coordinator knows of, once it registered."""
    members = list(coord.roster.members["backup"].values())
    assert len(members) <= 1, members
    return members[0] if members else None


async def _fenced(pool, addr, broker, epoch) -> bool:
    """Whether the backup refuses ``broker``'s ``epoch`` (an empty replicate stores nothing)."""
    try:
        await replicate(pool, addr, 0, 0, broker=broker, epoch=epoch)
    except Fenced:
        return True
    return False


async def test_registers_with_coordinator_and_reports_holds(backups, tmp_path):
    """Membership against a real coordinator: the backup registers with what it holds, comes
    back as itself when its heartbeats are refused (declared dead while paused) and after a
    restart, and takes the coordinator's fences from heartbeats and registrations."""
    data = tmp_path / "data"
    os.makedirs(data / "segments")
    a = chunks_for(3)
    p1 = str(data / "segments" / sf.file_name(5, 1, 3))
    sf.create(p1, 5, 1, 3, 2)
    n1 = sf.write(p1, 0, a, trailer=sf.encode_trailer(sum(map(len, a)), 3))
    p2 = str(data / "segments" / sf.file_name(6, 0, 0))
    sf.create(p2, 6, 0, 0, 1)
    n2 = sf.write(p2, 0, a[:2])
    port = free_port()
    coord = Coordinator(str(tmp_path / "coordinator"), dead_after=2.0, cluster_secret=SECRET)
    with trio.fail_after(40):
        # the coordinator starts after the backup: the backup keeps trying
        bk = backups(directory=data, args=["--coordinator", f"127.0.0.1:{port}", "--node", "n1"])
        assert bk.id_text == "-"
        async with trio.open_nursery() as nursery, open_members() as pool:
            await nursery.start(coord.run, "127.0.0.1", port)
            await until(lambda: _backup_member(coord) is not None, "first registration")
            first = _backup_member(coord)
            assert first.id == 1 and coord.metadata.state["backups"] == [1]  # no id of its own: a fresh one
            assert (first.addr, first.node, first.alive) == (bk.addr, "n1", True)
            assert first.holds == [[5, 1, 3, n1, True], [6, 0, 0, n2, False]]
            await until(lambda: load_id(str(data)) == first.id, "id saved")

            async def listed_as(bid):  # the id is saved before the service takes it
                return (await pool.call(bk.addr, "list", {}))[0]["backup"] == bid
            await until(lambda: listed_as(first.id), "the backup lists as its id")

            # fences reach the backup with its heartbeats
            assert not await _fenced(pool, bk.addr, 7, 3)
            coord.metadata.fence(7, 3)
            await until(lambda: _fenced(pool, bk.addr, 7, 3), "fence taken from a heartbeat")
            assert not await _fenced(pool, bk.addr, 7, 4)

            # paused past dead_after: declared dead, its heartbeats are refused, it registers
            # again as itself, in a new epoch, and heartbeats there
            bk.proc.send_signal(signal.SIGSTOP)
            try:
                await until(lambda: not first.alive, "declared dead", timeout=15)
            finally:
                bk.proc.send_signal(signal.SIGCONT)
            await until(lambda: _backup_member(coord) is not first, "registered again")
            second = _backup_member(coord)
            assert second.id == first.id and second.epoch > first.epoch and second.alive
            assert second.holds == first.holds
            seen = second.last_seen
            await until(lambda: second.last_seen > seen, "heartbeat in the new epoch")
            assert second.alive and _backup_member(coord) is second
            assert load_id(str(data)) == first.id

            # restarted (kill -9): the same id, and the fences it forgot are handed back
            await trio.to_thread.run_sync(bk.restart)  # the coordinator serves meanwhile
            assert bk.id_text == str(first.id)
            await until(lambda: _backup_member(coord) is not second, "registered after the restart")
            third = _backup_member(coord)
            assert third.id == first.id and third.epoch > second.epoch
            assert coord.metadata.state["backups"] == [first.id]
            await until(lambda: _fenced(pool, bk.addr, 7, 3), "fence known again after the restart")
            bk.kill()
            nursery.cancel_scope.cancel()


async def test_claimed_files_outlive_their_drop_until_released(backups):
    """A file an owner claims (an adopted segment reads from it) survives being dropped (here
    released below its vlog's floor; by its recovery in test_lets_go_...), and a restart, and
    goes with its last claim; malformed claims change nothing."""
    a = chunks_for(2)
    bk = backups()
    with trio.fail_after(30):
        async with open_members() as pool:
            for vseg in (0, 1):
                await replicate(pool, bk.addr, vseg, 0, a[vseg], close=True)
            for bad in ({"owner": 5, "epoch": 1, "claims": [[1, 0]]}, {"owner": -1, "epoch": 1, "claims": []},
                        {"owner": 5, "epoch": 1, "claims": "x"}, {"owner": 5, "claims": []}):
                with pytest.raises(InvalidArgument):
                    await pool.call(bk.addr, "claim", bad)
            assert not os.path.exists(os.path.join(bk.dir, "claims.meta"))
            r, _ = await pool.call(bk.addr, "claim", {"owner": 5, "epoch": 1, "claims": [[1, 0, 0], [1, 0, 9]]})
            assert r["held"] == [True, False]
            r, _ = await pool.call(bk.addr, "trim", {"broker": 1, "vlog": 0, "floor": 2})
            assert r["bytes"] > 0  # vseg 1's file; vseg 0's is only marked dropped
            assert os.path.exists(bk.seg(1, 0, 0)) and not os.path.exists(bk.seg(1, 0, 1))
            r, _ = await pool.call(bk.addr, "release", {"owner": 6, "epoch": 1})  # not its claim
            assert r == {"bytes": 0} and os.path.exists(bk.seg(1, 0, 0))
        bk.restart()
        async with open_members() as pool:
            assert os.path.exists(bk.seg(1, 0, 0))  # still claimed after a restart
            r, _ = await pool.call(bk.addr, "release", {"owner": 5, "epoch": 1, "claims": [[1, 0, 0]]})
            assert r["bytes"] > 0 and not os.path.exists(bk.seg(1, 0, 0))


async def test_lets_go_of_recovered_incarnations_it_learns_from_the_coordinator(backups, tmp_path):
    """The coordinator's list of incarnations recovered with nothing lost reaches a backup in
    heartbeat answers: their files go, one a live owner claims stays (marked dropped), their
    own claims are released; other incarnations' files stay, and so does a file past what its
    incarnation's recovery replayed (with that incarnation's claims). A restarted backup gets the list
    with its registration and applies it again, changing nothing. The list is emptied once
    every backup ever registered reported its version (one that reports none counts as none); a
    malformed list is refused and changes nothing."""
    a = chunks_for(1)
    e1, e2 = 1 << 32, 2 << 32   # vlog 0 of epochs 1 and 2
    port = free_port()
    coord = Coordinator(str(tmp_path / "coordinator"), dead_after=2.0, cluster_secret=SECRET)
    with trio.fail_after(40):
        bk = backups(args=["--coordinator", f"127.0.0.1:{port}"])
        async with trio.open_nursery() as nursery, open_members() as pool:
            await nursery.start(coord.run, "127.0.0.1", port)
            await until(lambda: _backup_member(coord) is not None, "registered")
            bid = _backup_member(coord).id

            def member():
                return coord.roster.members["backup"].get(bid)
            ghost = {"role": "backup", "addr": "127.0.0.1:1", "node": "gone"}   # applied none
            r, _ = await pool.call(f"127.0.0.1:{port}", "register", ghost)  # known, then away
            assert r["recovered"] == {"version": 0, "incarnations": []}
            ghost["id"] = r["id"]
            for b, vlog, vseg in ((4, e1, 0), (5, e1, 0), (5, e1, 1), (6, e1, 3)):
                await replicate(pool, bk.addr, vseg, 0, a[0], close=True, broker=b, vlog=vlog)
            # (5, 1) adopted a vseg of (4, 1), and (9, 1) one of (5, 1)
            for (owner, epoch), key in (((5, 1), [4, e1, 0]), ((9, 1), [5, e1, 0])):
                r, _ = await pool.call(bk.addr, "claim", {"owner": owner, "epoch": epoch, "claims": [key]})
                assert r["held"] == [True]
            await replicate(pool, bk.addr, 0, 0, a[0], close=True, broker=5, epoch=2, vlog=e2)

            def applied(version):
                return lambda: member().recovered == version

            coord.recovered.add(4, 1, [[e1, 0]])
            await coord.metadata.commit()   # told once durable
            await until(applied(1), "version 1 applied")
            assert os.path.exists(bk.seg(4, e1, 0))  # claimed by (5, 1): only marked dropped
            coord.recovered.add(5, 1, [[e1, 1]])
            coord.recovered.add(6, 1, [[e1, 2]])  # its vseg 3 lies past what its recovery replayed
            await coord.metadata.commit()
            await until(applied(3), "version 3 applied")
            left = sorted(os.listdir(os.path.join(bk.dir, "segments")))
            assert left == sorted([sf.file_name(5, e1, 0), sf.file_name(5, e2, 0), sf.file_name(6, e1, 3)]), left
            assert (await stats(pool, bk.addr))["claimed_files"] == 1
            assert [r[:3] for r in coord.metadata.state["recovered"]] == [[4, 1, 1], [5, 1, 2], [6, 1, 3]]  # the ghost

            first = member()
            await trio.to_thread.run_sync(bk.restart)
            await until(lambda: member() is not first and applied(3)(), "applied again")
            assert sorted(os.listdir(os.path.join(bk.dir, "segments"))) == left
            assert (await stats(pool, bk.addr))["claimed_files"] == 1

            r, _ = await pool.call(f"127.0.0.1:{port}", "register", {**ghost, "recovered": 3})
            assert "recovered" not in r and coord.metadata.state["recovered"] == []
            assert coord.metadata.state["recovered_version"] == 3

            # a malformed list is refused (typed, logged), changes nothing, and is not reported
            # as applied: the next answers bring the list again
            coord.metadata.store.set(("recovered",), [[4, -1, 4, []]])
            coord.metadata.store.set(("recovered_version",), 4)
            await coord.metadata.commit()
            await until(lambda: "recovered incarnations must be [[broker, epoch, [[vlog, vseg], ...]], ...]"
                        in bk.logs(), "the malformed list refused")
            assert member().recovered == 3 and sorted(os.listdir(os.path.join(bk.dir, "segments"))) == left
            coord.metadata.store.set(("recovered",), [])
            coord.metadata.store.set(("recovered_version",), 5)
            await coord.metadata.commit()
            await until(applied(5), "a well-formed list applied")
            bk.kill()
            nursery.cancel_scope.cancel()


async def test_a_recovered_entry_is_told_once_durable_and_dropped_while_its_owner_holds(tmp_path):
    """An entry is told only after a commit; a coordinator that loads an entry whose
    incarnation still owns streamlets (stored without all of its hand-over) removes it: that
    incarnation is recovered again before anyone lets go of its files."""
    d = str(tmp_path / "coordinator")
    coord = Coordinator(d, cluster_secret=SECRET)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(coord.metadata.store.run)
            coord.metadata.store.set(("streams", "s"), stream_meta(owners=((7, 1),)).to_wire())
            coord.recovered.add(7, 1, [])
            coord.recovered.add(8, 1, [])
            assert coord.recovered.shown == 0
            await coord.metadata.commit()
            assert coord.recovered.shown == 2
            nursery.cancel_scope.cancel()
    coord.metadata.store.close()
    again = Coordinator(d, cluster_secret=SECRET)
    assert again.metadata.state["recovered"] == [[8, 1, 2, []]] and again.recovered.shown == 2
    again.metadata.store.close()


async def test_index_lists_headers_from_memory_and_file_and_refuses_a_damaged_one(backups):
    """``index``: one row per chunk from its header (placement included), an index chunk
    following whole; the same from memory and from the file (rows kept since the close); once
    reloaded from the file, a header rotted on disk is a ``checksum`` error naming it, for
    that vseg only (the others of the request are answered), nothing stored changes; a
    malformed request is refused."""
    ix = index_chunk.SegmentIndex(3, 1, 2, 4, 1, 0, np.array([[100, 0, 0, 11, 0]], "<u8"), {0: [5]})
    a = [bytearray(c) for c in chunks_for(5)]
    for i, c in enumerate(a):
        chunk.place(c, 0, 2, 3, 1000 * i)
    a = [bytes(c) for c in a[:3]] + [index_chunk.build(ix, closed=True)] + [bytes(c) for c in a[3:]]
    starts = [sum(map(len, a[:i])) for i in range(len(a))]
    bk = backups(args=["--fsync", "always"])
    with trio.fail_after(20):
        async with open_members() as pool:
            for vseg in (0, 1):
                la = await send_all(pool, bk.addr, vseg, a)
                await replicate(pool, bk.addr, vseg, la, close=True)

            async def index(vseg=0):
                meta, parts = await pool.call(bk.addr, "index", {"broker": 1, "vsegs": [[0, vseg]]})
                data = b"".join(parts) if isinstance(parts, list) else bytes(parts)
                (e,) = meta["answers"]
                if "error" in e:
                    return e
                assert e["bytes"] == len(data)
                return e, np.frombuffer(data[:e["rows"]], "<u8").reshape(-1, INDEX_COLUMNS), data[e["rows"]:]

            _, rows, tail = await index()
            heads = [chunk.parse_header(c) for c in a]
            assert rows.tolist() == [
                [s, len(c), h.stream_id, h.streamlet, h.group, h.segment, h.offset, h.producer_id, h.sequence,
                 h.flags, chunk.HEADER.unpack_from(c)[15], h.record_count]
                for s, c, h in zip(starts, a, heads, strict=True)]
            assert tail == a[3] and rows[3, 9] == chunk.INDEX | chunk.CLOSE

            async def runs_of(vseg=0):
                meta, parts = await pool.call(bk.addr, "index", {"broker": 1, "vsegs": [[0, vseg, True]]})
                data = b"".join(parts) if isinstance(parts, list) else bytes(parts)
                (e,) = meta["answers"]
                return data[:e["rows"]], data[e["rows"]:e["bytes"]]

            want = index_runs(rows).astype("<u8").tobytes()
            assert await runs_of() == (want, tail)   # kept since the close: the index chunk from memory
            await until(lambda: _memory_zero(pool, bk.addr), "memory released")
            assert await runs_of() == (want, tail)   # ... and from the file
            _, again, tail_again = await index()  # now from the file
            assert (again == rows).all() and tail_again == tail
            before = open(bk.seg(1, 0, 0), "rb").read()
            flip_bits(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts[4] + 30, 1 << 2)
            rotted = open(bk.seg(1, 0, 0), "rb").read()
            _, kept, _ = await index()  # the rows kept since the close (a read verifies the chunk)
            assert (kept == rows).all()
            await trio.to_thread.run_sync(bk.restart)  # found on reload: not indexed at all
            assert (await index())["error"] == "backup"
            with open(bk.seg(1, 0, 0), "r+b") as f:
                f.write(before)
            await trio.to_thread.run_sync(bk.restart)  # reloaded whole: no rows kept, headers read
            assert ((await index())[1] == rows).all()
            flip_bits(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts[4] + 30, 1 << 2)
            e = await index()
            assert e["error"] == "checksum" and f"header at {starts[4]}: chunk header checksum" in e["message"]
            assert open(bk.seg(1, 0, 0), "rb").read() == rotted != before
            assert ((await index(1))[1] == rows).all()
            # many vsegs in one request: each answered on its own, in order
            meta, parts = await pool.call(bk.addr, "index", {"broker": 1, "vsegs": [[0, 0], [0, 1], [0, 9]]})
            got = meta["answers"]
            assert [sorted(e) for e in got] == [["error", "message"], ["bytes", "rows"], ["error", "message"]]
            assert got[1]["bytes"] == sum(map(len, parts if isinstance(parts, list) else [parts]))
            # as runs of chunks (what a recovery plans from): each vseg's rows joined on its own
            meta, parts = await pool.call(bk.addr, "index", {"broker": 1, "vsegs": [[0, 1, True], [0, 0, True],
                                                                                  [0, 1, False], [0, 1, True]]})
            data = b"".join(parts) if isinstance(parts, list) else bytes(parts)
            assert meta["answers"][1]["error"] == "checksum"
            for e, want in zip(meta["answers"][::2] + meta["answers"][3:], (index_runs(rows), rows, index_runs(rows)),
                               strict=True):
                assert data[:e["rows"]] == want.astype("<u8").tobytes()
                assert data[e["rows"]:e["bytes"]] == tail
                data = data[e["bytes"]:]
            assert data == b""
            for bad in ({"broker": 1, "vsegs": []}, {"broker": 1, "vsegs": [[0]]}, {"broker": 1, "vlog": 0, "vseg": 1},
                        {"vsegs": [[0, 1]]}, {"broker": 1, "vsegs": [[0, -1]]}, {"broker": 1, "vsegs": [[0, 1]] * 257},
                        {"broker": 1, "vsegs": [[0, 1, 1]]}, {"broker": 1, "vsegs": [[0, 1, True, 0]]}):
                with pytest.raises(InvalidArgument):
                    await pool.call(bk.addr, "index", bad)


async def test_a_verified_index_reads_every_body_back_and_refuses_a_rotten_copy(backups):
    """``index`` asked ``[vlog, vseg, runs, true]`` (a copy a recovery would adopt from alone)
    reads the copy's bodies back from its file and verifies them first: a flipped bit in a
    chunk's body, which no header shows and the rows kept since the close do not see, is a
    ``checksum`` error naming the chunk, the replica is marked corrupt (listed so, indexed no
    more), nothing stored changes; an intact copy, on file or still in memory, gets the
    same rows as unverified; a fifth element is refused."""
    a = chunks_for(40)
    starts = [sum(map(len, a[:i])) for i in range(len(a))]
    bk = backups(args=["--fsync", "always"])
    with trio.fail_after(20):
        async with open_members() as pool:
            async def index(vseg, verify):
                meta, parts = await pool.call(bk.addr, "index", {"broker": 1, "vsegs": [[0, vseg, False, verify]]})
                (e,) = meta["answers"]
                data = b"".join(parts) if isinstance(parts, list) else bytes(parts)
                return e if "error" in e else data

            for vseg in (0, 1):
                la = await send_all(pool, bk.addr, vseg, a)
                await replicate(pool, bk.addr, vseg, la, close=True)
            rows = await index(0, False)
            assert await index(0, True) == rows   # in memory (verified as it came) or on file
            await until(lambda: _memory_zero(pool, bk.addr), "memory released")
            before = (await stats(pool, bk.addr))["verified_bytes"]
            assert await index(0, True) == rows == await index(1, True)   # read back from the file
            flip_bits(bk.seg(1, 0, 0), sf.FILE_HEADER_SIZE + starts[23] + chunk.HEADER_SIZE + 3, 1 << 5)
            rotted = open(bk.seg(1, 0, 0), "rb").read()
            assert await index(0, False) == rows   # the rows kept since the close: no body read
            e = await index(0, True)
            assert e["error"] == "checksum" and f"chunk at {starts[23]} is corrupt" in e["message"]
            assert (await index(0, False))["error"] == "backup"   # marked corrupt: indexed no more
            listed, _ = await pool.call(bk.addr, "list", {"broker": 1})
            (rep,) = [r for r in listed["segments"] if r["vseg"] == 0]
            assert [c["offset"] for c in rep["corrupt"]] == [starts[23]]
            assert open(bk.seg(1, 0, 0), "rb").read() == rotted
            assert await index(1, True) == rows   # the other vseg of the request's kind: served
            # each read whole three times; the rotten one counts nothing
            assert (await stats(pool, bk.addr))["verified_bytes"] - before == 3 * la
            with pytest.raises(InvalidArgument):
                await pool.call(bk.addr, "index", {"broker": 1, "vsegs": [[0, 1, False, True, True]]})


async def test_read_chunks_takes_each_chunk_where_it_is(backups):
    """``read_chunks`` of an evicted segment whose chunks lie below the memory base (in the
    file only), in written bytes still in memory and in bytes not written yet (periodic mode:
    in memory only) serves each from where it is, in the order asked; none is read from a
    file that does not hold it."""
    old, new = chunks_for(6), chunks_for(2, seq0=6)
    a1, a2 = sum(map(len, old[:3])), sum(map(len, old[3:]))
    # memory is released (once written and fsynced) only over --max-memory, which bounds the
    # bytes not yet written: the old chunks go in two flush rounds, the first three released
    bk = backups(args=["--fsync", "periodic", "--flush-interval", "1", "--fsync-interval", "0.05",
                       "--max-memory", str(a1 + a2 - 1)])
    every = old + new
    starts = [sum(map(len, every[:i])) for i in range(len(every))]
    with trio.fail_after(20):
        async with open_members() as pool:
            await send_all(pool, bk.addr, 0, old[:3])
            await until(lambda: _memory_is(pool, bk.addr, a1, unflushed=0), "the first chunks written", 10)
            await send_all(pool, bk.addr, 0, old[3:], offset0=a1)
            await until(lambda: _memory_is(pool, bk.addr, a2, unflushed=0),
                        "all written, the first chunks' memory released", 10)
            await send_all(pool, bk.addr, 0, new, offset0=a1 + a2)
            assert (await stats(pool, bk.addr))["unflushed_bytes"] == sum(map(len, new))
            order = [6, 0, 7, 4]
            meta, parts = await pool.call(bk.addr, "read_chunks", {
                "broker": 1, "vlog": 0, "vseg": 0, "ranges": [[starts[i], len(every[i])] for i in order]})
            data = b"".join(bytes(p) for p in (parts if isinstance(parts, list) else [parts]))
            assert meta["chunks"] == 4 and data == b"".join(every[i] for i in order)
            assert (await stats(pool, bk.addr))["unflushed_bytes"] == sum(map(len, new)), "read before the flush"
            # bad ranges: refused with a typed error, nothing marked corrupt, the good read still served
            def kept(seg):   # what a refused read must not change (a flush round may run meanwhile)
                return seg["length"], seg["chunks"], seg["corrupt"]

            listed = kept((await segments(pool, bk.addr))[(1, 0, 0)])
            for bad in ("x", [], [[starts[1]]], [[starts[1] + 1, len(every[1])]],
                        [[starts[1], len(every[1]) + 1]], [[-1, 5]], [[starts[0], len(every[0])], ["a", 1]]):
                with pytest.raises(InvalidArgument):
                    await pool.call(bk.addr, "read_chunks", {"broker": 1, "vlog": 0, "vseg": 0, "ranges": bad})
            assert kept((await segments(pool, bk.addr))[(1, 0, 0)]) == listed
            _, again = await pool.call(bk.addr, "read_chunks", {
                "broker": 1, "vlog": 0, "vseg": 0, "ranges": [[starts[i], len(every[i])] for i in order]})
            assert b"".join(bytes(p) for p in (again if isinstance(again, list) else [again])) == data


async def _memory_is(pool, addr, n, unflushed):
    st = await stats(pool, addr)
    return st["memory_bytes"] == n and st["unflushed_bytes"] == unflushed
