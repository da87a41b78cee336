"""Server addresses: ``HOST:PORT`` parsed, and the address a server is reached at."""

from __future__ import annotations

WILDCARDS = ("", "0.0.0.0", "::")


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, not {addr!r}")
    return host, int(port)


def advertised(host: str, port: int, advertise: str = "") -> str:
    """The address others reach a server at: ``advertise`` (HOST:PORT, or HOST with the port it
    bound), else the host it binds and that port (127.0.0.1 for a wildcard host, which no peer
    can dial)."""
    if advertise:
        return advertise if ":" in advertise else f"{advertise}:{port}"
    return f"{'127.0.0.1' if host in WILDCARDS else host}:{port}"
