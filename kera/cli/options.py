"""What every client command takes, and how it runs.

Every client command takes ``--coordinator HOST:PORT[,HOST:PORT...]`` (env
KERA_COORDINATOR, default ``kera.coordinator.link.DEFAULT``) and ``--config FILE`` (env
KERA_CONFIG: the security settings, ``kera.security.client_config``). A command's
error prints ``error: CODE: message`` and exits 1.
"""

from __future__ import annotations

import sys

import trio

from ..coordinator.link import default_addrs
from ..errors import KeraError
from ..security import client_config


def client(p):
    """``p``, a client command's parser, with the options every client command takes."""
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT[,HOST:PORT...] of the coordinators (env KERA_COORDINATOR)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="security settings, key=value lines with the Kafka client's names "
                        "(security.protocol, sasl.username, ssl.ca.location...; env KERA_CONFIG)")
    return p


def coordinator(args) -> str:
    return args.coordinator or default_addrs()


def config(args) -> dict | None:
    """The security settings ``--config`` names (None: those of ``KERA_CONFIG``, if set)."""
    return client_config.read(args.config) if getattr(args, "config", None) else None


def run(afn, *args):
    """``afn(*args)`` in trio; a ``KeraError`` is printed and exits 1."""
    try:
        return trio.run(afn, *args)
    except KeraError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        sys.exit(1)


def describe(e: BaseException) -> str:
    """An error, or each of a group's, as one line."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"
