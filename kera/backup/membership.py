"""A backup's identity and its membership in the cluster.

The id the coordinator assigns is kept in ``DIR/backup.id`` (msgpack) so a
restarted backup comes back as itself, with the segments it still holds.
Registration is retried with capped exponential backoff (the coordinator may
start later); heartbeats go every ``HEARTBEAT_INTERVAL``; a coordinator that
*answers* a heartbeat with an error (fenced, unknown id, ...) gets a new
registration, while an unreachable one just gets more heartbeats.
"""

from __future__ import annotations

import logging
import os

import msgpack
import trio

from ..errors import KeraError, Unavailable
from .segment_file import fsync_dir

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
    fsync_dir(directory)


async def run_membership(service, coordinator, addr: str, node: str | None) -> None:
    """Register, then heartbeat forever; lives in the service's nursery."""
    while True:
        epoch = await _register(service, coordinator, addr, node)
        await _heartbeat(service, coordinator, epoch)


async def _register(service, coordinator, addr: str, node: str | None) -> int:
    delay = BACKOFF_MIN
    while True:
        meta = {"role": "backup", "addr": addr, "node": node, "id": service.id,
                "epoch": service.epoch,  # claimed back after a coordinator restart
                "holds": service.holds()}
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
        log.info("registered with %s as backup %d, epoch %d", coordinator, bid, epoch)
        service.apply_fences(r.get("fences"))
        service.epoch = epoch
        service.registered.set()
        return epoch


async def _heartbeat(service, coordinator, epoch: int) -> None:
    """Returns when the coordinator refuses us: the caller registers again."""
    while True:
        await trio.sleep(HEARTBEAT_INTERVAL)
        try:
            r, _ = await coordinator.call("heartbeat", {"role": "backup", "id": service.id, "epoch": epoch},
                                         timeout=RPC_TIMEOUT)
            service.apply_fences(r.get("fences"))
        except Unavailable as e:
            log.debug("heartbeat to %s failed: %s", coordinator, e)
        except KeraError as e:
            log.warning("coordinator refused heartbeat (%s: %s): registering again", e.code, e)
            return
