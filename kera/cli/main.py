"""The ``kera`` command: servers, a local cluster, and client commands.

Each command's module adds its parsers and names its commands (``COMMANDS``); here they
are put together and the one asked for is run. ``kera coordinator|broker|backup ARGS``
hands ARGS to that server's own command line, untouched.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import access, kv, records, servers, status, streams

PARTS = (servers, streams, records, status, kv, access)   # in the order ``kera --help`` lists them


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kera", description="kera: stream storage for many small streams")
    sub = ap.add_subparsers(dest="command", required=True)
    for part in PARTS:
        part.add_parsers(sub)
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in servers.ROLES:
        servers.serve(argv[0], argv[1:])
        return
    args = parser().parse_args(argv)
    commands = {name: cmd for part in PARTS for name, cmd in part.COMMANDS.items()}
    try:
        commands[args.command](args)
    except* BrokenPipeError:
        # the reader of our output went away (``kera stream list | head``): stop quietly, as
        # Unix tools do; stdout goes to /dev/null so the interpreter's final flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
