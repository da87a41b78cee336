"""Coordinator metadata in etcd, and the election of the coordinator that leads.

Keys under the prefix P (values are msgpack):

- ``P leader``: the leading coordinator's address, attached to its lease;
- ``P coordinators/ADDR``: every running coordinator, attached to its lease
  (what ``kera status`` lists as standbys);
- ``P m/TOP``: a top-level value of the state (``next_stream_id``, ``backups``);
- ``P m/TOP/KEY``: one entry of a top-level map (``streams/NAME``,
  ``positions/GROUP``, ``fences/BROKER``, ``next_id/ROLE``).

Why one key per entry: a change costs O(that entry), never O(all metadata),
and a new leader reads the whole state with a few paged range requests.
The entries of ``packed`` maps (the coordinator's ``streams``) stay the bytes
etcd holds, decoded only by whoever reads one (``kera.coordinator.metalog`` says why).

``EtcdMeta`` has ``MetaLog``'s interface: changes apply to ``state`` at once
and mark their entry dirty; ``commit()`` returns once every entry changed so
far is in etcd. The writer sends dirty entries in transactions, each guarded
by "the leader key still has the create revision of my election": a deposed
leader (paused, cut off) can never overwrite its successor's metadata. Counters
and fences go in the first transaction of a batch, so a batch cut short by a
crash at worst skips ids, never reuses them.
"""

from __future__ import annotations

import copy
import logging

import msgpack
import trio

from .. import limits
from ..errors import NotLeader
from . import etcd as e
from .metalog import apply

log = logging.getLogger("kera.etcd_meta")

TTL = 2                 # seconds a leader's lease outlives its last keep-alive
POLL = 0.2              # a standby's campaign period
MAX_TXN_OPS = 128       # etcd's default --max-txn-ops
# counters and fences first (ids never reused); pending adoptions before the owners they
# come with (kera.recovery.adoption: owners never stored without the record), and with the recovered
# entry that replaces one once it is done (never the one without the other)
_FIRST = ("next_stream_id", "next_producer_id", "next_epoch", "next_id", "fences", "backups", "deferred",
          "recovered", "recovered_version")


def _pack(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def _unpack(b: bytes):
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


class Election:
    """Campaign for the leader key; hold it while the lease is kept alive."""

    def __init__(self, client: e.Etcd, prefix: str, addr: str, ttl: int = TTL):
        self.etcd, self.addr, self.ttl = client, addr, ttl
        self.key = (prefix + "leader").encode()
        self.member_key = (prefix + "coordinators/" + addr).encode()
        self.members_prefix = (prefix + "coordinators/").encode()
        self.lease = 0
        self.revision = 0          # create revision of our leader key while we lead
        self.leader = ""           # the address last seen in the leader key
        self.valid_until = 0.0     # trio clock: past it we may no longer act as leader

    async def _lease(self) -> int:
        """A live lease of ours, with our membership key on it."""
        if self.lease:
            try:
                if await self.etcd.keepalive(self.lease, timeout=1.0) > 0:
                    return self.lease
            except e.EtcdError:
                return 0
        self.lease, _ = await self.etcd.grant(self.ttl)
        await self.etcd.txn([], [e.put(self.member_key, self.addr.encode(), self.lease)])
        return self.lease

    async def campaign(self) -> None:
        """Until this coordinator leads (``revision`` set); meanwhile ``leader`` names who does."""
        while True:
            try:
                sent = trio.current_time()
                lease = await self._lease()
                if lease:
                    r = await self.etcd.txn([e.created_at(self.key, 0)],
                                            [e.put(self.key, self.addr.encode(), lease)],
                                            [e.get(self.key)])
                    if r["succeeded"]:
                        self.revision, self.leader = r["revision"], self.addr
                        self.valid_until = sent + self.ttl * 0.8
                        log.info("leading (election revision %d)", self.revision)
                        return
                    for _k, v, rev, owner in e.kvs_of(r):
                        self.leader = v.decode()
                        if owner == lease and self.leader == self.addr:
                            # still ours (etcd was away, our lease outlived it): lead on
                            self.revision = rev
                            self.valid_until = sent + self.ttl * 0.8
                            log.info("leading again (election revision %d)", rev)
                            return
            except e.EtcdError as err:
                log.info("etcd unreachable while standing by: %s", err)
            await trio.sleep(POLL)

    def leading(self) -> bool:
        return bool(self.revision) and trio.current_time() < self.valid_until

    async def hold(self) -> None:
        """Keep the lease alive; returns once leadership may have been lost (the lease
        expired, or etcd was out of reach for longer than the lease could last)."""
        while True:
            await trio.sleep(self.ttl / 5)
            sent = trio.current_time()
            try:
                with trio.move_on_at(self.valid_until) as cs:
                    ttl = await self.etcd.keepalive(self.lease, timeout=self.ttl / 2)
                if cs.cancelled_caught:
                    break
                if ttl <= 0:
                    log.warning("leader lease expired")
                    break
                self.valid_until = sent + self.ttl * 0.8
            except e.EtcdError as err:
                if trio.current_time() >= self.valid_until:
                    log.warning("etcd out of reach for the whole lease: %s", err)
                    break
        self.revision = 0   # the lease is kept: if it outlived the gap, campaign finds it ours

    def guard(self) -> list[dict]:
        return [e.created_at(self.key, self.revision)]

    async def standbys(self) -> list[str]:
        rows = await self.etcd.range_prefix(self.members_prefix)
        return sorted(v.decode() for _k, v in rows if v.decode() != self.addr)

    async def resign(self) -> None:
        if self.lease:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 1):
                try:
                    await self.etcd.revoke(self.lease)
                except e.EtcdError:
                    pass
            self.lease = self.revision = 0


class EtcdMeta:
    """The coordinator's state, kept in etcd while ``election`` holds the leadership."""

    def __init__(self, client: e.Etcd, prefix: str, election: Election, initial: dict, packed=()):
        self.etcd, self.election = client, election
        self.prefix = (prefix + "m/").encode()
        self.initial = initial
        self.maps = {k for k, v in initial.items() if isinstance(v, dict)}
        self.packed = frozenset(packed)
        self.state: dict = {}
        self._dirty: dict[tuple, None] = {}
        self._recorded = 0
        self._durable = 0
        self._wake = trio.Event()
        self._written = trio.Event()
        self.closed = False
        self.cut: list = []   # MetaLog's torn tails: none here

    async def load(self) -> dict:
        """The whole state from etcd (a new leader's first step)."""
        state = copy.deepcopy(self.initial)
        rows = await self.etcd.range_prefix(self.prefix)
        for k, v in rows:
            top, _, sub = k[len(self.prefix):].decode().partition("/")
            if top in self.packed:
                state.setdefault(top, {})[sub] = v
            elif top in self.maps:
                state.setdefault(top, {})[sub] = _unpack(v)
            else:
                state[top] = _unpack(v)
        self.state = state
        log.info("metadata loaded from etcd: %d keys", len(rows))
        return state

    def _key(self, entry: tuple) -> bytes:
        return self.prefix + "/".join(str(p) for p in entry).encode()

    # -- recording (event loop) -----------------------------------------------------------
    def _record(self, path: tuple) -> None:
        self._dirty[(path[0], str(path[1])) if path[0] in self.maps and len(path) > 1
                    else (path[0],)] = None
        self._recorded += 1
        self._wake.set()

    def set(self, path: tuple, value) -> None:
        apply(self.state, ("set", path, value), self.packed)
        self._record(path)

    def delete(self, path: tuple) -> None:
        apply(self.state, ("del", path), self.packed)
        self._record(path)

    def merge(self, path: tuple, mapping: dict) -> None:
        apply(self.state, ("merge", path, mapping), self.packed)
        self._record(path)

    async def commit(self) -> None:
        """Until every change recorded so far is in etcd; ``NotLeader`` if leadership ends first."""
        target = self._recorded
        while self._durable < target:
            if self.closed:
                raise NotLeader("this coordinator stopped leading before the change was stored",
                                leader=self.election.leader)
            await self._written.wait()

    def close(self) -> None:
        self.closed = True
        self._written.set()

    # -- the writer -------------------------------------------------------------------------
    def _value(self, entry: tuple):
        d = self.state
        for p in entry:
            if not isinstance(d, dict) or p not in d:
                return None
            d = d[p]
        return d

    def _ops(self, entries: list[tuple]) -> list[list[dict]]:
        """Puts and deletes in transactions within etcd's limits, counters and fences first."""
        entries.sort(key=lambda en: en[0] not in _FIRST)
        txns, ops, size = [], [], 0
        for en in entries:
            v = self._value(en)
            raw = type(v) is bytes and en[0] in self.packed   # packed already
            op = e.delete(self._key(en)) if v is None else e.put(self._key(en), v if raw else _pack(v))
            n = len(str(op))
            if ops and (len(ops) >= MAX_TXN_OPS or size + n > limits.MAX_TXN_BYTES):
                txns.append(ops)
                ops, size = [], 0
            ops.append(op)
            size += n
        if ops:
            txns.append(ops)
        return txns

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Group commit to etcd; ends (raising ``NotLeader``) if a guarded write is refused."""
        task_status.started()
        try:
            while True:
                while not self._dirty:
                    self._wake = trio.Event()
                    await self._wake.wait()
                entries, self._dirty = list(self._dirty), {}
                upto = self._recorded
                for ops in self._ops(entries):
                    await self._write(ops)
                self._durable = upto
                self._written.set()
                self._written = trio.Event()
        finally:
            self.close()

    async def _write(self, ops: list[dict]) -> None:
        delay = 0.05
        while True:
            try:
                r = await self.etcd.txn(self.election.guard(), ops)
            except e.EtcdError as err:
                log.warning("metadata write to etcd failed (%s); retrying", err)
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if not r["succeeded"]:
                raise NotLeader("the leader key changed hands: another coordinator leads")
            return
