"""A backup's identity and its membership in the cluster.

The id the coordinator assigns is kept in ``DIR/backup.id`` (msgpack) so a
restarted backup comes back as itself, with the segments it still holds.
Registration is retried with capped exponential backoff (the coordinator may
start later); heartbeats go every ``HEARTBEAT_INTERVAL``; a coordinator that
*answers* a heartbeat with an error (fenced, unknown id, ...) gets a new
registration, while an unreachable one just gets more heartbeats.

Both say which version of the coordinator's list of recovered incarnations
(``kera.coordinator.recovered``) this backup applied; an answer carries the list when
the version moved, and a task beside the heartbeats lets go of their files
and claims (so deleting many files never delays a heartbeat). The version
applied is kept in memory only: a restarted backup gets the list again with
its registration and applies it again, idempotently.
"""

from __future__ import annotations

import logging
import os

import msgpack
import trio

from ..errors import KeraError, Unavailable
from ..metafile import fsync_path

log = logging.getLogger("kera.backup")

ID_FILE = "backup.id"
HEARTBEAT_INTERVAL = 0.5
RPC_TIMEOUT = 5.0
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0


def load_id(directory: str) -> int | None:
    path = os.path.join(directory, ID_FILE)
    try:
        with open(path, "rb") as f:
            data = msgpack.unpackb(f.read(), raw=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, msgpack.ExtraData) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None
    bid = data.get("id") if isinstance(data, dict) else None
    return bid if isinstance(bid, int) else None


def save_id(directory: str, bid: int, node: str | None) -> None:
    """Write the id atomically (temp file, fsync, rename, fsync dir)."""
    path = os.path.join(directory, ID_FILE)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb({"id": bid, "node": node}, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(directory)


class LetGo:
    """Applies the newest list of recovered incarnations the coordinator sent, off the
    heartbeats' path; ``applied`` is the version done (None until the first)."""

    def __init__(self, service):
        self.service = service
        self.applied: int | None = None
        self._doing: int | None = None
        self._wanted: dict | None = None
        self._kick = trio.Event()

    def offer(self, answer: dict) -> None:
        r = answer.get("recovered")
        if isinstance(r, dict) and r.get("version") not in (self.applied, self._doing):
            self._wanted = r
            self._kick.set()

    async def run(self) -> None:
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            r, self._wanted = self._wanted, None
            self._doing = r.get("version")
            try:
                await self.service.let_go(r.get("incarnations"))
                self.applied = self._doing   # a failure is retried: the next answer brings it again
            except (KeraError, OSError) as e:
                log.warning("letting go of recovered incarnations failed (%s); retrying with the "
                            "next heartbeat", e)
            finally:
                self._doing = None


async def run_membership(service, coordinator, addr: str, node: str | None) -> None:
    """Register, then heartbeat forever; lives in the service's nursery."""
    let_go = LetGo(service)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(let_go.run)
        while True:
            epoch = await _register(service, coordinator, addr, node, let_go)
            await _heartbeat(service, coordinator, epoch, let_go)


async def _register(service, coordinator, addr: str, node: str | None, let_go: LetGo) -> int:
    delay = BACKOFF_MIN
    while True:
        meta = {"role": "backup", "addr": addr, "node": node, "id": service.id,
                "epoch": service.epoch,  # claimed back after a coordinator restart
                "holds": service.holds(), "recovered": let_go.applied, "auth": service.gate.auth}
        try:
            r, _ = await coordinator.call("register", meta, timeout=RPC_TIMEOUT)
            bid, epoch = int(r["id"]), int(r["epoch"])
        except (KeraError, KeyError, TypeError, ValueError) as e:
            log.info("registration with %s failed (%s); retrying in %.2f s", coordinator, e, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
            continue
        if bid != service.id:
            await trio.to_thread.run_sync(save_id, service.dir, bid, node)
            service.id = bid
        service.credentials.set_id(bid)   # our connections open again, as this backup
        log.info("registered with %s as backup %d, epoch %d", coordinator, bid, epoch)
        service.apply_fences(r.get("fences"))
        if r.get("security") is not None:
            service.gate.apply(r["security"])
        let_go.offer(r)
        service.epoch = epoch
        service.registered.set()
        return epoch


async def _heartbeat(service, coordinator, epoch: int, let_go: LetGo) -> None:
    """Returns when the coordinator refuses us: the caller registers again."""
    while True:
        await trio.sleep(HEARTBEAT_INTERVAL)
        try:
            r, _ = await coordinator.call("heartbeat", {"role": "backup", "id": service.id, "epoch": epoch,
                                                        "recovered": let_go.applied,
                                                        "damage": service.counters["damage"],
                                                        "security": service.gate.version,
                                                        **_metrics(service)},
                                          timeout=RPC_TIMEOUT)
            service.apply_fences(r.get("fences"))
            if r.get("security") is not None:   # a push it missed
                service.gate.apply(r["security"])
            let_go.offer(r)
        except Unavailable as e:
            log.debug("heartbeat to %s failed: %s", coordinator, e)
        except KeraError as e:
            log.warning("coordinator refused heartbeat (%s: %s): registering again", e.code, e)
            return


def _metrics(service) -> dict:
    """Where the backup's metrics are served, for ``kera status`` (nothing without them)."""
    return {"stats": {"metrics": service.metrics.addr}} if service.metrics is not None else {}
