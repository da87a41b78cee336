"""The cluster secret: what makes a process a member of the cluster.

``kera up`` makes one (32 random bytes, hex, in ``<data>/cluster.secret``, mode 0600) and
hands its path to every server it starts; a server started alone is given
``--cluster-secret-file PATH``. A file that others than its owner may read is refused,
as ssh refuses such a key. The secret itself never crosses the wire: connections prove
they know it (``mechanisms.MemberServer``), and the keys used for other purposes are
derived from it (``derive``), so that one proof never serves as another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

SECRET_FILE = "cluster.secret"


class SecretError(Exception):
    """The cluster secret file is missing, unreadable, malformed or readable by others."""


def make(path: str) -> bytes:
    """A new secret at ``path`` (created 0600, never overwritten); returns it."""
    secret = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def load(path: str) -> bytes:
    try:
        st = os.stat(path)
        with open(path) as f:
            text = f.read().strip()
    except OSError as e:
        raise SecretError(f"cluster secret {path}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"cluster secret {path} is readable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SecretError(f"cluster secret {path} is not hex") from None
    if len(secret) < 16:
        raise SecretError(f"cluster secret {path} is too short: 16 bytes at least")
    return secret


def ensure(path: str) -> bytes:
    """The secret at ``path``, made first if there is none (``kera up``)."""
    if not os.path.exists(path):
        return make(path)
    return load(path)


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose only (member proofs, producer-id tokens), from the secret."""
    return hmac.new(secret, b"kera/" + purpose.encode(), hashlib.sha256).digest()


def add_arguments(ap) -> None:
    """A server's security options (every server takes the same)."""
    ap.add_argument("--cluster-secret-file", default=os.environ.get("KERA_CLUSTER_SECRET_FILE"),
                    metavar="PATH", help="the cluster secret every member proves it knows (made "
                    "by `kera up` in its data dir; env KERA_CLUSTER_SECRET_FILE)")
    ap.add_argument("--auth", action="store_true",
                    help="user authentication (SCRAM) and ACLs: a client must log in, and may do "
                         "only what its ACLs allow")


def from_args(ap, args) -> bytes:
    """The secret the options name; exits with a message if there is none or it is bad."""
    if not args.cluster_secret_file:
        ap.error("--cluster-secret-file PATH is required (`kera up` makes one in its data dir)")
    try:
        return load(args.cluster_secret_file)
    except SecretError as e:
        ap.error(str(e))
