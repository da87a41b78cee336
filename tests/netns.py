"""Partitions for real: each server of a cluster in its own Linux network namespace.

Every host has one IPv4 address in a /24 of its own (10.A.B.0/24, picked so no
route of this machine covers it) and every pair of hosts its own veth pair (a
full mesh), so any pair can be cut alone. The test process is a host as well,
``client``, staying in the root namespace with links of its own: a client cut
from one broker is one pair like any other. Servers bind and advertise their
host's address (``LocalCluster(hosts=network)``, ``--host``).

How a cut is made silent. Each end of a link carries the host's address with
the peer's (``ip addr add A peer B dev X``), which gives the /32 route to the
peer through that link. Cutting a pair sets both ends of its veth down: the
kernel deletes those /32 routes (and brings them back with the addresses when
the link is set up again), so traffic to the peer falls to a catch-all route
for the cluster's /24 through the host's *sink*: a veth whose other end stays
down, with ARP off, so whatever is sent there is dropped without a word.
Measured (two namespaces, an established TCP connection, then a cut):

- both ends down, no sink: the connection is silent, but a new connect fails
  at once with ENETUNREACH (the route is gone);
- one end down: a new connect fails after 0.8 s with EHOSTUNREACH (ARP gives up);
- the route (address) removed: ENETUNREACH at once, as the first;
- both ends down with the sink: the connection is silent (sends are taken,
  nothing arrives, no reset, no error) and a new connect times out, as across a
  real partition; after the heal the same connection delivers what was sent
  (the kernel's retransmission, after its backoff).

Names are unique per harness (``kera-<pid>-<n>-<host>`` namespaces; in the
root namespace ``kn<pid in hex>x<n>...`` devices), namespaces left by a test process
that died are removed by the next harness, and ``close`` removes everything
(its cluster's processes stopped first), whatever happened.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import subprocess

PREFIX = "kera-"
CLIENT = "client"
_count = itertools.count(1)


def _ip(args: list[str], *, netns: str | None = None, batch: list[str] | None = None,
        check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *(["-batch", "-"] if batch is not None else args)]
    r = subprocess.run(argv, input="\n".join(batch or []) + "\n" if batch is not None else None,
                       capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}"
                           + (f"\n{chr(10).join(batch)}" if batch else ""))
    return r.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Remove the namespaces and root devices of harnesses whose process died."""
    for line in _ip(["netns", "list"]).splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if name.startswith(PREFIX) and len(parts) >= 3 and parts[1].isdigit() \
                and not _alive(int(parts[1])):
            _ip(["netns", "del", name], check=False)
    for line in _ip(["-o", "link", "show"]).splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        pid, x, _ = dev[2:].partition("x")
        if dev.startswith("kn") and x and pid and all(c in "0123456789abcdef" for c in pid) \
                and not _alive(int(pid, 16)):
            _ip(["link", "del", dev], check=False)


def _networks(text: str) -> list:
    out = []
    for word in text.split():
        try:
            out.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            pass
    return out


def _subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.128.0.0/9 that no address or route of the root namespace as specific lies in
    (another harness's included); wider routes are no matter, the /24's own are more specific."""
    used = [n for n in _networks(_ip(["-4", "-o", "route", "show", "table", "all"])
                                 + _ip(["-4", "-o", "addr", "show"]))
            if n.version == 4 and n.prefixlen >= 24]
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{random.randint(128, 254)}.{random.randint(0, 255)}.0/24")
        if not any(u.overlaps(net) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.128.0.0/9 for the test network")


class Network:
    """Hosts in namespaces with a link per pair; ``cut``/``heal`` one pair, ``isolate``/``rejoin``
    a group of hosts (cut from every host outside it, links inside it kept). Also the
    ``kera.cluster.Hosts`` of a ``LocalCluster`` whose process names are the host names."""

    def __init__(self, hosts: list[str]):
        sweep()
        n = next(_count)
        self.tag = f"{os.getpid():x}x{n}"           # root devices: kn<tag>...
        self.prefix = f"{PREFIX}{os.getpid()}-{n}-"   # namespaces: <prefix><host>
        self.net = _subnet()
        self.hosts = [*hosts, CLIENT]
        ips = list(self.net.hosts())
        self.ip = {h: str(ips[i]) for i, h in enumerate(self.hosts)}
        self.index = {h: i for i, h in enumerate(self.hosts)}
        self.down: set[frozenset] = set()
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # -- names ----------------------------------------------------------------------------
    def netns(self, host: str) -> str | None:
        return None if host == CLIENT else self.prefix + host

    def dev(self, host: str, peer: str) -> str:
        """The device of ``host``'s end of its link to ``peer``."""
        return f"kn{self.tag}-{self.index[peer]}" if host == CLIENT else f"p{self.index[peer]}"

    def _sink(self, host: str) -> tuple[str, str]:
        return (f"kn{self.tag}s", f"kn{self.tag}z") if host == CLIENT else ("sink", "sinkz")

    # -- making and removing ------------------------------------------------------------------
    def _make(self) -> None:
        for h in self.hosts:
            if h != CLIENT:
                _ip(["netns", "add", self.netns(h)])
                self.made.append(self.netns(h))
        links = []
        for a, b in itertools.combinations(self.hosts, 2):
            ends = [f"{self.dev(h, p)}" + (f" netns {self.netns(h)}" if h != CLIENT else "")
                    for h, p in ((a, b), (b, a))]
            links.append(f"link add {ends[0]} type veth peer name {ends[1]}")
        sink, sinkz = self._sink(CLIENT)
        links.append(f"link add {sink} type veth peer name {sinkz}")
        _ip([], batch=links)
        for h in self.hosts:
            sink, sinkz = self._sink(h)
            cmds = [] if h == CLIENT else ["link set lo up", f"addr add {self.ip[h]}/32 dev lo",
                                           f"link add {sink} type veth peer name {sinkz}"]
            cmds += [f"link set {sink} arp off up", f"route add {self.net} dev {sink} metric 4000"]
            for p in self.hosts:
                if p != h:
                    cmds += [f"addr add {self.ip[h]} peer {self.ip[p]} dev {self.dev(h, p)}",
                             f"link set {self.dev(h, p)} up"]
            _ip([], netns=self.netns(h), batch=cmds)

    def close(self) -> None:
        """Remove every namespace (their devices and the root ends of their links go with them)
        and the root namespace's sink. The processes in them must be stopped first."""
        for ns in self.made:
            _ip(["netns", "del", ns], check=False)
        self.made = []
        _ip(["link", "del", self._sink(CLIENT)[0]], check=False)
        for p in self.hosts:   # a link whose namespace end was not made yet
            if p != CLIENT:
                _ip(["link", "del", self.dev(CLIENT, p)], check=False)

    # -- kera.cluster.Hosts -------------------------------------------------------------
    def address(self, name: str) -> str:
        return self.ip[name]

    def command(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns(name), *argv]

    # -- faults ---------------------------------------------------------------------------------
    def _set(self, pairs, state: str) -> None:
        per_host: dict[str, list[str]] = {}
        for a, b in pairs:
            for h, p in ((a, b), (b, a)):
                per_host.setdefault(h, []).append(f"link set {self.dev(h, p)} {state}")
        for h, cmds in per_host.items():
            _ip([], netns=self.netns(h), batch=cmds)
        for a, b in pairs:
            (self.down.add if state == "down" else self.down.discard)(frozenset((a, b)))

    def cut(self, a: str, b: str) -> None:
        """Packets between ``a`` and ``b`` are dropped, silently, both ways."""
        self._set([(a, b)], "down")

    def heal(self, a: str, b: str) -> None:
        self._set([(a, b)], "up")

    def _outside(self, group) -> list[tuple[str, str]]:
        inside = set(group)
        return [(a, b) for a in inside for b in self.hosts if b not in inside]

    def isolate(self, *group: str) -> None:
        """Cut every link between ``group`` and the other hosts (the client included)."""
        self._set(self._outside(group), "down")

    def rejoin(self, *group: str) -> None:
        self._set(self._outside(group), "up")

    def heal_all(self) -> None:
        self._set([tuple(p) for p in self.down], "up")
