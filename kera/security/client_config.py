"""A client's security settings, by the Kafka client's names, and the file that holds them.

``client.conf`` (``kera up --auth`` / ``--tls`` writes one into its data dir) is one
``key=value`` per line, ``#`` comments, with the names librdkafka and the Java client
use, so the same file configures either:

- ``security.protocol``: PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL;
- ``sasl.mechanism`` (or librdkafka's ``sasl.mechanisms``): SCRAM-SHA-256 (default),
  SCRAM-SHA-512 or PLAIN; ``sasl.username``, ``sasl.password``;
- ``ssl.ca.location``: the CA that signed the servers' certificates;
  ``ssl.certificate.location`` and ``ssl.key.location``: a client certificate;
  ``ssl.endpoint.identification.algorithm``: ``https`` (default: the server's name is
  checked against its certificate) or ``none``.

Clients take the same names as options; with none given, the file that ``KERA_CONFIG``
names. Other keys of a file (``bootstrap.servers``...) are ignored; an unknown
security key given as an option is refused.
"""

from __future__ import annotations

import os
import ssl

from ..errors import InvalidArgument
from .credentials import Credentials
from .mechanisms import PLAIN, SCRAM

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KEYS = ("security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username",
        "sasl.password", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
        "ssl.endpoint.identification.algorithm")
ENV = "KERA_CONFIG"


class ConfigError(InvalidArgument, ValueError):
    """A client configuration that cannot work (a bad value, a missing user or file)."""


def read(path: str) -> dict[str, str]:
    """The ``key=value`` lines of a file (its security keys; others are ignored)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"client config {path}: {e.strerror or e}") from None
    out = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not eq:
            raise ConfigError(f"{path}:{n}: not key=value")
        if key.strip() in KEYS:
            out[key.strip()] = value.strip()
    return out


def write(path: str, settings: dict[str, str], comment: str = "") -> None:
    """``settings`` as a client config file, readable by its owner only (it may hold a
    password)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        if comment:
            f.write("".join(f"# {line}\n" for line in comment.splitlines()))
        f.write("".join(f"{k}={v}\n" for k, v in settings.items()))


def settings(config: dict | None) -> dict[str, str]:
    """The security settings of ``config`` (a client's options; keys not about security are
    left to the client), or of the ``KERA_CONFIG`` file when it gives none."""
    given = {k: v for k, v in (config or {}).items() if k in KEYS}
    if not given and os.environ.get(ENV):
        return read(os.environ[ENV])
    return given


def credentials(config: dict | None = None) -> Credentials:
    """What a client's connections present, from its settings (``settings``)."""
    s = settings(config)
    protocol = s.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"security.protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    tls = context(s) if protocol.endswith("SSL") else None
    if not protocol.startswith("SASL"):
        return Credentials(tls=tls)
    mech = s.get("sasl.mechanism", s.get("sasl.mechanisms", SCRAM[0])).upper()
    if mech not in (*SCRAM, PLAIN):
        raise ConfigError(f"sasl.mechanism must be one of {', '.join((*SCRAM, PLAIN))}, not {mech!r}")
    if not s.get("sasl.username") or "sasl.password" not in s:
        raise ConfigError(f"security.protocol {protocol} needs sasl.username and sasl.password")
    return Credentials(mechanism=mech, user=s["sasl.username"], password=s["sasl.password"], tls=tls)


def context(s: dict) -> ssl.SSLContext:
    """A client TLS context: the servers' CA (or the system's), a client certificate if given."""
    try:
        ctx = ssl.create_default_context(cafile=s.get("ssl.ca.location") or None)
        if s.get("ssl.certificate.location"):
            ctx.load_cert_chain(s["ssl.certificate.location"], s.get("ssl.key.location") or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"TLS settings: {e}") from None
    if s.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        ctx.check_hostname = False
    return ctx
