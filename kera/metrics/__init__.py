"""Prometheus metrics of every server (``--metrics-port``): ``endpoint`` serves them,
``broker``, ``backup`` and ``coordinator`` read each server's counters, ``lag`` measures
consumer groups' lag. Only the command-line options live here: a server started without
the option imports nothing of it."""

from __future__ import annotations


def add_arguments(parser) -> None:
    """``--metrics-port`` and ``--metrics-host`` on a server's command line."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics over HTTP at /metrics on this port (0: any "
                             "free port; default: no endpoint)")
    parser.add_argument("--metrics-host", default=None, metavar="HOST",
                        help="address the metrics endpoint listens on (default: --host)")
