"""What TLS costs on this CPU at the least: ``python -m bench tls-floor [--mb N]``.

The raw cost of the ``ssl`` module moving bytes through memory BIOs, in the shapes
``kera.rpc.channel`` uses (``TLS_PIECE`` encrypted at once, ``RECV_SIZE`` decrypted per
receive into a buffer, then copied out), with no socket, no frames and no scheduler: the
floor under what any Python server on ``ssl`` pays per byte that crosses TLS. Measured for
the suite kera negotiates (TLS 1.3, OpenSSL's first choice: AES-256-GCM) and, for
comparison, TLS 1.2 suites Python 3.11 can choose (AES-128-GCM, ChaCha20-Poly1305; its
``ssl`` cannot choose among TLS 1.3 suites), beside a plain memory copy.

``ceiling`` turns it into the best ``--auth --tls`` / default ratio a CPU-bound cluster can
reach: a record produced at R=3 crosses TLS three times (producer -> broker -> two backups),
each crossing encrypted once and decrypted once, on top of the CPU a record costs by default
(the machine's cores over the default rate, when they are all busy).
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
import time

from kera.limits import RECV_SIZE, TLS_PIECE, TLS_RECORD
from kera.security import tls

CROSSINGS_R3 = 3   # producer -> broker, broker -> each of two backups
SUITES = (("TLS 1.3 (kera's)", None),
          ("TLS 1.2 AES-128-GCM", "ECDHE-ECDSA-AES128-GCM-SHA256"),
          ("TLS 1.2 ChaCha20-Poly1305", "ECDHE-ECDSA-CHACHA20-POLY1305"))


def _pair(files: dict, suite: str | None):
    """A client and a server ``SSLObject`` over memory BIOs, handshake done."""
    server, client = tls.server_context(files["cert"], files["key"]), tls.client_context(files["ca"])
    if suite is not None:
        for ctx in (server, client):
            ctx.maximum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_ciphers(suite)
    bios = [ssl.MemoryBIO() for _ in range(4)]   # client in/out, server in/out
    c = client.wrap_bio(bios[0], bios[1], server_hostname="localhost")
    s = server.wrap_bio(bios[2], bios[3], server_side=True)
    for _ in range(8):
        for obj, out, peer_in in ((c, bios[1], bios[2]), (s, bios[3], bios[0])):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
            peer_in.write(out.read())
    return c, bios[1], s, bios[2]


def _cost(files: dict, suite: str | None, nbytes: int) -> dict:
    """ns per byte to encrypt (pieces of ``TLS_PIECE``) and to decrypt (receives of
    ``RECV_SIZE``, read into a buffer and copied out, as ``channel.Tls`` does)."""
    piece = os.urandom(TLS_PIECE)
    c, c_out, _, _ = _pair(files, suite)
    t0 = time.perf_counter()
    for _ in range(nbytes // TLS_PIECE):   # the ciphertext let go, as a sent one is
        c.write(piece)
        c_out.read()
    enc = time.perf_counter() - t0
    c, c_out, s, s_in = _pair(files, suite)   # another pair's, kept, to be decrypted
    sealed = []
    for _ in range(nbytes // TLS_PIECE):
        c.write(piece)
        sealed.append(c_out.read())
    wire = memoryview(b"".join(sealed))
    del sealed
    buf = memoryview(bytearray(RECV_SIZE + TLS_RECORD))
    got, t0 = 0, time.perf_counter()
    for at in range(0, len(wire), RECV_SIZE):
        s_in.write(wire[at:at + RECV_SIZE])
        n = 0
        try:
            while n <= RECV_SIZE:
                n += s.read(TLS_RECORD, buf[n:])
        except ssl.SSLWantReadError:
            pass
        got += len(bytes(buf[:n]))
    dec = time.perf_counter() - t0
    assert got == nbytes // TLS_PIECE * TLS_PIECE
    return {"suite": s.cipher()[0], "version": s.version(), "encrypt_ns_per_byte": round(enc / got * 1e9, 3),
            "decrypt_ns_per_byte": round(dec / got * 1e9, 3),
            "crossing_ns_per_byte": round((enc + dec) / got * 1e9, 3),
            "wire_overhead": round(len(wire) / got - 1, 5)}


def _copy_ns_per_byte(nbytes: int) -> float:
    src = bytearray(os.urandom(RECV_SIZE))
    t0 = time.perf_counter()
    for _ in range(nbytes // RECV_SIZE):
        bytes(src)
    return round((time.perf_counter() - t0) / nbytes * 1e9, 3)


def measure(mb: int = 256, suites=SUITES, repeats: int = 3) -> dict:
    """Each suite's costs (the best of ``repeats`` runs of ``mb`` MiB: a floor), and a copy's."""
    with tempfile.TemporaryDirectory() as d:
        files = tls.local_ca(d)
        rows = []
        for name, suite in suites:
            runs = [_cost(files, suite, mb << 20) for _ in range(repeats)]
            best = min(runs, key=lambda r: r["crossing_ns_per_byte"])
            rows.append({"name": name, **best})
    return {"mb": mb, "repeats": repeats, "suites": rows, "copy_ns_per_byte": _copy_ns_per_byte(mb << 20),
            "cpu": _cpu(), "openssl": ssl.OPENSSL_VERSION}


def ceiling(crossing_ns: float, tls_bytes_per_record: float, plain_rps: float, cores: int) -> dict:
    """The best secure / default ratio of a cluster whose ``cores`` are all busy at the default
    rate ``plain_rps``, when TLS adds only its floor per byte crossing it."""
    base_us = cores / plain_rps * 1e6
    floor_us = tls_bytes_per_record * crossing_ns / 1000
    return {"cpu_us_per_record": round(base_us, 3), "tls_floor_us_per_record": round(floor_us, 3),
            "ceiling": round(base_us / (base_us + floor_us), 3)}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def main(argv) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench tls-floor")
    ap.add_argument("--mb", type=int, default=256, help="MiB moved per suite and run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    res = {"experiment": "tls-floor", **measure(args.mb)}
    print(f"{res['cpu']}, {res['openssl']}: ns per byte, best of {res['repeats']} x {res['mb']} MiB")
    print("| suite | encrypt | decrypt | a crossing (both) |\n|---|---|---|---|")
    for r in res["suites"]:
        print(f"| {r['name']}: {r['suite']} | {r['encrypt_ns_per_byte']} | {r['decrypt_ns_per_byte']} | "
              f"{r['crossing_ns_per_byte']} |")
    print(f"a memory copy: {res['copy_ns_per_byte']} ns per byte")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tls-floor.json"), "w") as f:
        json.dump(res, f, indent=1)
