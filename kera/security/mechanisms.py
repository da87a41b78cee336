"""Authentication mechanisms, sans-IO: bytes in, bytes out, an identity at the end.

A connection authenticates once, at its start, with ``authenticate`` requests that carry
one mechanism's messages (Kafka's SaslAuthenticate): the first names the mechanism. Each
server side is a ``step`` machine that answers a client message with the next message
and, at the end, the identity proved; each client side makes its messages and checks
the server's (every mechanism here is mutual: the client learns the server knows the
secret or the user's keys). The trio code only carries the messages.

- ``KERA-MEMBER``: a cluster member (coordinator, broker, backup) proves knowledge of
  the cluster secret by a challenge-response with a nonce from each side, HMAC-SHA256
  over both nonces and the identity claimed (role, id). Nothing replayable crosses the
  wire, and the server proves the same knowledge first.
- ``SCRAM-SHA-256`` / ``SCRAM-SHA-512``: users, as Kafka does them (RFC 5802/7677, by the
  ``scramp`` package); the server holds salted keys only.
- ``PLAIN``: user and password in the clear, checked against the same salted keys;
  only over TLS (``Gate`` refuses it elsewhere).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import msgpack
import scramp

from ..errors import AuthenticationFailed, UnsupportedMechanism

MEMBER = "KERA-MEMBER"
SCRAM = ("SCRAM-SHA-256", "SCRAM-SHA-512")
PLAIN = "PLAIN"
MECHANISMS = (MEMBER, *SCRAM, PLAIN)

COORDINATOR, BROKER, BACKUP, CLIENT = "coordinator", "broker", "backup", "client"
MEMBER_ROLES = (COORDINATOR, BROKER, BACKUP)
NONCE = 32


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a connection proved to be: a member (``role``, its ``id``, None before it has
    one) or a user (``role`` client, ``principal`` ``User:NAME``)."""

    role: str
    id: int | None
    principal: str


def member_principal(role: str, mid: int | None) -> str:
    return f"Member:{role}-{'new' if mid is None else mid}"


def _unpack(data: bytes, what: str) -> dict:
    try:
        m = msgpack.unpackb(data, raw=False)
    except Exception:  # noqa: BLE001 (msgpack raises several unrelated types)
        raise AuthenticationFailed(f"malformed {what}") from None
    if not isinstance(m, dict):
        raise AuthenticationFailed(f"malformed {what}")
    return m


def _transcript(role: str, mid, nc: bytes, ns: bytes) -> bytes:
    return msgpack.packb([role, mid, nc, ns], use_bin_type=True)


def _mac(key: bytes, side: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, side + transcript, hashlib.sha256).digest()


class MemberServer:
    """The server side of ``KERA-MEMBER``: two steps, the second yields the member."""

    def __init__(self, key: bytes):
        self.key = key
        self.transcript: bytes | None = None
        self.claim: tuple | None = None

    def step(self, data: bytes) -> tuple[bytes, Identity | None]:
        if self.transcript is None:
            m = _unpack(data, "member hello")
            role, mid, nc = m.get("role"), m.get("id"), m.get("nonce")
            if role not in MEMBER_ROLES or not (mid is None or type(mid) is int and 0 < mid < 1 << 63) \
                    or not isinstance(nc, bytes) or len(nc) != NONCE:
                raise AuthenticationFailed("a member hello is {role, id, nonce}")
            ns = secrets.token_bytes(NONCE)
            self.claim = (role, mid)
            self.transcript = _transcript(role, mid, nc, ns)
            return msgpack.packb({"nonce": ns, "proof": _mac(self.key, b"server", self.transcript)},
                                 use_bin_type=True), None
        proof = _unpack(data, "member proof").get("proof")
        if not isinstance(proof, bytes) or not hmac.compare_digest(
                proof, _mac(self.key, b"client", self.transcript)):
            raise AuthenticationFailed("wrong cluster secret")
        role, mid = self.claim
        return b"", Identity(role, mid, member_principal(role, mid))


class MemberClient:
    """The member side of ``KERA-MEMBER``: refuses a server that does not know the secret."""

    name = MEMBER

    def __init__(self, key: bytes, role: str, mid: int | None):
        self.key, self.role, self.id = key, role, mid
        self.nonce = secrets.token_bytes(NONCE)

    def first(self) -> bytes:
        return msgpack.packb({"role": self.role, "id": self.id, "nonce": self.nonce}, use_bin_type=True)

    def step(self, data: bytes) -> bytes:
        m = _unpack(data, "member challenge")
        ns, proof = m.get("nonce"), m.get("proof")
        if not isinstance(ns, bytes) or not isinstance(proof, bytes):
            raise AuthenticationFailed("malformed member challenge")
        transcript = _transcript(self.role, self.id, self.nonce, ns)
        if not hmac.compare_digest(proof, _mac(self.key, b"server", transcript)):
            raise AuthenticationFailed("the server does not know the cluster secret")
        return msgpack.packb({"proof": _mac(self.key, b"client", transcript)}, use_bin_type=True)

    def finish(self, data: bytes) -> None:
        pass


# -- users ---------------------------------------------------------------------------

def credentials(password: str, mechanisms=SCRAM, iterations: int | None = None) -> dict:
    """A user's stored keys for each SCRAM mechanism, made from ``password`` (which is not
    kept): ``{mechanism: [salt, stored key, server key, iterations]}``."""
    out = {}
    for m in mechanisms:
        salt, stored, server, i = scramp.ScramMechanism(m).make_auth_info(password, iterations)
        out[m] = [salt, stored, server, i]
    return out


def check_credentials(creds) -> dict:
    """A credentials map as stored, or ValueError."""
    if not isinstance(creds, dict) or not creds or not set(creds) <= set(SCRAM):
        raise ValueError(f"credentials are {{mechanism: [salt, stored key, server key, iterations]}} "
                         f"for mechanisms among {', '.join(SCRAM)}")
    for v in creds.values():
        if not (isinstance(v, list) and len(v) == 4 and all(isinstance(x, bytes) for x in v[:3])
                and type(v[3]) is int and 4096 <= v[3] <= 10_000_000 and 8 <= len(v[0]) <= 64
                and 32 <= len(v[1]) <= 64 and 32 <= len(v[2]) <= 64):
            raise ValueError("a mechanism's credentials are [salt, stored key, server key, iterations]")
    return creds


class ScramServer:
    """The server side of SCRAM: ``users(name)`` gives a user's stored keys (None: unknown)."""

    def __init__(self, mechanism: str, users):
        def auth_fn(name):
            creds = users(name)
            got = creds.get(mechanism) if creds else None
            return tuple(got) if got else None

        self.server = scramp.ScramMechanism(mechanism).make_server(auth_fn)
        self.user: str | None = None

    def step(self, data: bytes) -> tuple[bytes, Identity | None]:
        try:
            text = data.decode()
            if self.user is None:
                self.server.set_client_first(text)
                self.user = _user_of(text)
                return self.server.get_server_first().encode(), None
            self.server.set_client_final(text)
            out = self.server.get_server_final().encode()
        except (scramp.ScramException, UnicodeDecodeError, ValueError) as e:
            raise AuthenticationFailed(f"SCRAM: {_why(e)}") from None
        return out, Identity(CLIENT, None, f"User:{self.user}")


def _user_of(client_first: str) -> str:
    """The user a SCRAM client-first message names (``n,,n=NAME,r=...``), unescaped."""
    bare = client_first.split(",", 2)[2]
    for part in bare.split(","):
        if part.startswith("n="):
            return part[2:].replace("=2C", ",").replace("=3D", "=")
    raise ValueError("no user name")


def _why(e: Exception) -> str:
    text = str(e)
    if "Unknown user" in text or "client keys don't match" in text or "other-error" in text:
        return "wrong user name or password"
    return text


class ScramClient:
    def __init__(self, mechanism: str, user: str, password: str):
        self.name = mechanism
        self.client = scramp.ScramClient([mechanism], user, password)

    def first(self) -> bytes:
        return self.client.get_client_first().encode()

    def step(self, data: bytes) -> bytes:
        try:
            self.client.set_server_first(data.decode())
            return self.client.get_client_final().encode()
        except (scramp.ScramException, UnicodeDecodeError) as e:
            raise AuthenticationFailed(f"SCRAM: {e}") from None

    def finish(self, data: bytes) -> None:
        try:
            self.client.set_server_final(data.decode())
        except (scramp.ScramException, UnicodeDecodeError) as e:
            raise AuthenticationFailed(f"SCRAM: the server could not prove it holds the user's "
                                       f"keys ({e})") from None


class PlainServer:
    """PLAIN (RFC 4616), checked against the user's stored SCRAM keys."""

    def __init__(self, users):
        self.users = users

    def step(self, data: bytes) -> tuple[bytes, Identity | None]:
        try:
            _, user, password = data.decode().split("\0")
        except ValueError:
            raise AuthenticationFailed("PLAIN takes \\0user\\0password") from None
        creds = self.users(user) or {}
        for m, (salt, stored, _, i) in sorted(creds.items()):
            if hmac.compare_digest(scramp.ScramMechanism(m).make_auth_info(password, i, salt)[1], stored):
                return b"", Identity(CLIENT, None, f"User:{user}")
        raise AuthenticationFailed("wrong user name or password")


class PlainClient:
    name = PLAIN

    def __init__(self, user: str, password: str):
        self.user, self.password = user, password

    def first(self) -> bytes:
        return f"\0{self.user}\0{self.password}".encode()

    def step(self, data: bytes) -> bytes:
        raise AuthenticationFailed("PLAIN has one message")

    def finish(self, data: bytes) -> None:
        pass


def client_mechanism(mechanism: str, user: str, password: str):
    if mechanism in SCRAM:
        return ScramClient(mechanism, user, password)
    if mechanism == PLAIN:
        return PlainClient(user, password)
    raise UnsupportedMechanism(f"sasl.mechanism {mechanism!r}: one of {', '.join((*SCRAM, PLAIN))}")
