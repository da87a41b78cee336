"""The coordinator's metadata: an append-only, checksummed log of changes plus snapshots.

Why: rewriting the whole metadata on every change makes each stream create cost
O(all streams). Here a change costs O(its own size), many changes share one
fsync (group commit), and the disk work runs in a worker thread so heartbeats
and other requests never wait on it.

The state is a dict of plain msgpack values. A change names a key path in it:
``set(("streams", name), s)``, ``delete(("streams", name))``,
``merge(("positions", group), {...})`` (a dict update, creating the dict).
The change is applied to ``state`` at once and packed at once (later in-place
edits of the value do not leak into the log); ``await commit()`` returns once
every change recorded so far is on disk. The log is one ordered sequence, so a
durable change implies every earlier change is durable too.

*Packed* maps (``packed``: top-level keys, the coordinator's ``streams``)
hold each entry as its msgpack bytes, not as Python objects: a million
streams' maps as dicts cost a few KiB each, packed a fifth of that. The files
do not change: an entry is spliced into the log and the snapshot as the map
it packs, and read back as those bytes without being decoded. A change below
an entry (``set(("streams", name, "owners", 1), ...)``) decodes it, applies
and packs it again (``apply``).

Files in the directory, G a generation number:

- ``meta-G.snap``: the whole state before the changes of ``meta-G.log``
  (``kera.metafile`` format: written to a temp file, fsynced, renamed);
  generation 0 has no snapshot file (the initial state).
- ``meta-G.log``: records, each ``magic, body length, xxh64(body)`` then the
  body, a run of msgpack changes. One record is one group-commit batch (split
  only past ``MAX_METALOG_RECORD``), so a crash tears at most the last record.

When the log outgrows ``ratio`` times the snapshot, the writer starts log
G+1 and writes snapshot G+1 in another thread while new changes go on into
log G+1; once the snapshot is renamed into place, generation G is removed.
The amortised cost of snapshots per change stays O(1).

Opening loads the newest snapshot G and replays ``meta-G.log``,
``meta-(G+1).log`` … (the latter exists when a crash came before snapshot
G+1 was done). A bad record with no valid record after it is a torn write:
it is cut, logged, and kept in ``cut``. A bad record *followed by a valid
one* is damage to changes that were acknowledged: ``CorruptMetaLog`` is raised
and the coordinator does not start, rather than silently drop or skip them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import struct

import msgpack
import trio
import xxhash

from .. import limits, metafile

log = logging.getLogger("kera.metalog")

_HEAD = struct.Struct("<4sIQ")
_MAGIC = b"KML1"
_NAME = re.compile(r"meta-(\d{6,})\.(snap|log)$")


class CorruptMetaLog(Exception):
    """The metadata on disk is damaged beyond a torn tail: refusing to guess."""


@dataclasses.dataclass(frozen=True)
class TornTail:
    """A torn last record cut at open: ``dropped`` bytes from ``offset`` of ``path``."""

    path: str
    offset: int
    dropped: int
    reason: str


def frame(body: bytes) -> bytes:
    return _HEAD.pack(_MAGIC, len(body), xxhash.xxh64_intdigest(body)) + body


def _check(data, off: int) -> tuple[int, str | None]:
    """(end of the record at ``off``, None) if it is whole and valid, else (off, why not)."""
    if len(data) - off < _HEAD.size:
        return off, "short header"
    magic, n, check = _HEAD.unpack_from(data, off)
    if magic != _MAGIC:
        return off, "bad magic"
    end = off + _HEAD.size + n
    if n > limits.MAX_METALOG_RECORD or end > len(data):
        return off, "short body"
    if xxhash.xxh64_intdigest(data[off + _HEAD.size:end]) != check:
        return off, "checksum mismatch"
    return end, None


def scan(data: bytes) -> tuple[list[memoryview], int, str | None]:
    """The valid records' bodies, where they end, and why the rest (if any) is not one.

    Raises CorruptMetaLog if a valid record lies anywhere after a bad one."""
    view = memoryview(data)
    bodies, off = [], 0
    while off < len(data):
        end, bad = _check(data, off)
        if bad is not None:
            at = data.find(_MAGIC, off + 1)
            while at != -1:
                if _check(data, at)[1] is None:
                    raise CorruptMetaLog(f"bad record at byte {off} ({bad}) followed by a valid "
                                         f"one at byte {at}: acknowledged changes are damaged")
                at = data.find(_MAGIC, at + 1)
            return bodies, off, bad
        bodies.append(view[off + _HEAD.size:end])
        off = end
    return bodies, off, None


def apply(state: dict, change, packed=()) -> None:
    """One change to ``state``. Paths are strict: only ``merge`` creates its (last) dict.

    An entry of a ``packed`` map is kept as msgpack bytes: a value set there is packed
    (if it is not bytes already), and a change below it is applied to its decoded map,
    which is packed again."""
    kind, path = change[0], change[1]
    if packed and path[0] in packed and len(path) > 1:
        entries = state[path[0]]
        if len(path) > 2:
            entry = unpack(entries[path[1]])
            apply({path[1]: entry}, (kind, path[1:], *change[2:]))
            entries[path[1]] = pack(entry)
        elif kind == "set":
            v = change[2]
            entries[path[1]] = v if type(v) is bytes else pack(v)
        elif kind == "del":
            entries.pop(path[1], None)
        else:
            raise CorruptMetaLog(f"change {kind!r} of a whole packed entry")
        return
    d = state
    for k in path[:-1]:
        d = d[k]
    last = path[-1]
    if kind == "set":
        d[last] = change[2]
    elif kind == "del":
        d.pop(last, None)
    elif kind == "merge":
        d.setdefault(last, {}).update(change[2])
    else:
        raise CorruptMetaLog(f"unknown change {kind!r}")


def pack(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def unpack(b):
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


def _pack_change(change, packed=()) -> bytes:
    """A change as the log holds it; the bytes of a packed entry go in as the map they are."""
    if packed and len(change) == 3 and type(change[2]) is bytes and change[1][0] in packed \
            and len(change[1]) == 2:
        p = msgpack.Packer(use_bin_type=True)
        return b"".join((p.pack_array_header(3), p.pack(change[0]), p.pack(change[1]), change[2]))
    return pack(change)


def _changes(body, packed=()):
    """The changes of a record's body; a whole entry of a ``packed`` map comes as its bytes."""
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=limits.MAX_METALOG_RECORD)
    u.feed(body)
    if not packed:
        yield from u
        return
    while True:
        try:
            n = u.read_array_header()
        except msgpack.OutOfData:
            return
        kind, path = u.unpack(), u.unpack()
        if n == 2:
            yield (kind, path)
            continue
        if kind == "set" and len(path) == 2 and path[0] in packed:
            start = u.tell()
            u.skip()
            yield (kind, path, bytes(body[start:u.tell()]))
        else:
            yield (kind, path, *(u.unpack() for _ in range(n - 2)))


def _load_snapshot(path: str, packed=()) -> dict:
    """A snapshot's ``{"gen", "state"}``, the entries of ``packed`` maps as their bytes."""
    body = metafile.load_body(path)
    if not packed:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(body) + 1)
    u.feed(body)
    out: dict = {}
    for _ in range(u.read_map_header()):
        k = u.unpack()
        if k != "state":
            out[k] = u.unpack()
            continue
        state = out[k] = {}
        for _ in range(u.read_map_header()):
            top = u.unpack()
            if top not in packed:
                state[top] = u.unpack()
                continue
            entries = state[top] = {}
            for _ in range(u.read_map_header()):
                name = u.unpack()
                start = u.tell()
                u.skip()
                entries[name] = body[start:u.tell()]
    return out


def _pack_snapshot(gen: int, state: dict, packed=()) -> bytes:
    """The snapshot body, packed item by item so a large state never holds the GIL long
    (the entries of ``packed`` maps are packed already: they go in as they are)."""
    p = msgpack.Packer(use_bin_type=True)
    out = [p.pack_map_header(2), p.pack("gen"), p.pack(gen), p.pack("state"),
           p.pack_map_header(len(state))]
    for k, v in state.items():
        out.append(p.pack(k))
        if isinstance(v, dict):
            out.append(p.pack_map_header(len(v)))
            raw = k in packed
            for k2, v2 in v.items():
                out.append(p.pack(k2))
                out.append(v2 if raw else p.pack(v2))
        else:
            out.append(p.pack(v))
    return b"".join(out)


def _shared_copy(state: dict, packed=()) -> dict:
    """A copy of ``state`` that shares the (immutable) entries of its packed maps."""
    return {k: dict(v) if k in packed else copy.deepcopy(v) for k, v in state.items()}


class MetaLog:
    """The state, its log and snapshots in ``directory``; ``run`` is the writer task.

    ``initial``: the state of an empty directory, and the value of any of its
    top-level keys the stored state lacks.

    ``legacy``: a whole-state metafile of an older version, loaded and
    snapshotted (then removed) when the directory has no log yet.

    ``packed``: the top-level maps whose entries are kept as msgpack bytes (see the
    module's doc).
    """

    def __init__(self, directory: str, initial: dict, *, legacy: str | None = None,
                 ratio: float = 2.0, min_log: int = 1 << 20, packed=()):
        self.dir = directory
        self.ratio, self.min_log = ratio, min_log
        self.packed = frozenset(packed)
        self.cut: list[TornTail] = []
        os.makedirs(directory, exist_ok=True)
        self.state = self._open(initial, legacy)
        # the writer's own copy, for snapshots taken off the event loop (packed entries are
        # immutable bytes: shared with the state, not copied)
        self._shadow = _shared_copy(self.state, self.packed)
        # (packed change, the change for the shadow): written during a snapshot, applied after it
        self._deferred: list[tuple] = []
        self._pending: list[tuple] = []   # the same, not yet taken by the writer
        self._recorded = 0                # changes recorded so far
        self._durable = 0                 # changes on disk
        self._wake = trio.Event()
        self._written = trio.Event()
        self._snapshotting = False

    # -- files --------------------------------------------------------------------------
    def _path(self, gen: int, kind: str) -> str:
        return os.path.join(self.dir, f"meta-{gen:06d}.{kind}")

    def _files(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {"snap": set(), "log": set()}
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            if m:
                out[m.group(2)].add(int(m.group(1)))
            elif name.startswith("meta-") and name.endswith(".tmp"):
                os.remove(os.path.join(self.dir, name))   # a snapshot a crash interrupted
        return out

    def _open(self, initial: dict, legacy: str | None) -> dict:
        files = self._files()
        if not files["snap"] and not files["log"] and legacy and os.path.exists(legacy):
            state = metafile.load(legacy)
            for k in self.packed & state.keys():
                state[k] = {name: pack(v) for name, v in state[k].items()}
            self._write_snapshot(1, state)
            os.remove(legacy)
            metafile.fsync_path(self.dir)
            log.info("metadata of %s moved into a log at %s", legacy, self.dir)
            files = self._files()
        elif legacy and os.path.exists(legacy):   # moved already; a crash came before its removal
            os.remove(legacy)
        snap = max(files["snap"], default=0)
        state = {}
        if snap:
            obj = _load_snapshot(self._path(snap, "snap"), self.packed)
            if obj.get("gen") != snap:
                raise CorruptMetaLog(f"{self._path(snap, 'snap')} holds generation {obj.get('gen')}")
            state = obj["state"]
        for k, v in initial.items():   # an empty directory, or keys newer than the snapshot
            state.setdefault(k, copy.deepcopy(v))
        logs = sorted(g for g in files["log"] if g >= snap)
        if logs and logs != list(range(snap, snap + len(logs))):
            raise CorruptMetaLog(f"{self.dir}: logs {logs} do not follow snapshot {snap}")
        for g in logs:
            self._replay(state, g, last=g == logs[-1])
        self._snap_bytes = os.path.getsize(self._path(snap, "snap")) if snap else 0
        self.gen = logs[-1] if logs else snap
        if len(logs) > 1:   # a snapshot was interrupted: take it now, while nobody waits
            self.gen += 1
            self._snap_bytes = self._write_snapshot(self.gen, state)
        self._remove_before(self.gen)
        path = self._path(self.gen, "log")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._log_bytes = os.fstat(self._fd).st_size
        metafile.fsync_path(self.dir)
        return state

    def _replay(self, state: dict, gen: int, last: bool) -> None:
        path = self._path(gen, "log")
        with open(path, "rb") as f:
            data = f.read()
        try:
            bodies, end, bad = scan(data)
        except CorruptMetaLog as e:
            log.critical("%s: %s", path, e)
            raise CorruptMetaLog(f"{path}: {e}") from None
        for body in bodies:
            for change in _changes(body, self.packed):
                try:
                    apply(state, change, self.packed)
                except (KeyError, IndexError, TypeError) as e:
                    raise CorruptMetaLog(f"{path}: change {change!r} does not fit the state "
                                         f"({e!r})") from None
        if bad is None:
            return
        if not last:   # a later log was started only after this one was whole on disk
            raise CorruptMetaLog(f"{path}: bad record at byte {end} ({bad}) before a later log")
        cut = TornTail(path, end, len(data) - end, bad)
        log.warning("%s: torn tail cut at byte %d (%d bytes, %s)", path, end, cut.dropped, bad)
        self.cut.append(cut)
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())

    def _write_snapshot(self, gen: int, state: dict) -> int:
        body = _pack_snapshot(gen, state, self.packed)
        metafile.save_packed(self._path(gen, "snap"), body)
        return len(body)

    def _remove_before(self, gen: int) -> None:
        files = self._files()
        for kind, gens in files.items():
            for g in gens:
                if g < gen:
                    os.remove(self._path(g, kind))
        metafile.fsync_path(self.dir)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- recording (event loop) -----------------------------------------------------------
    def _record(self, change: tuple) -> None:
        path = change[1]
        into = self.packed and path[0] in self.packed and len(path) > 1
        if into and len(change) == 3 and type(change[2]) is not bytes and len(path) == 2:
            change = (change[0], path, pack(change[2]))
        packed = _pack_change(change, self.packed)
        if len(packed) > limits.MAX_METALOG_RECORD:
            raise ValueError(f"a metadata change of {len(packed)} bytes exceeds MAX_METALOG_RECORD")
        apply(self.state, change, self.packed)
        shadow = None   # the shadow takes a packed entry as the state now holds it (shared)
        if into:
            now = self.state[path[0]].get(path[1])
            shadow = ("del", path[:2]) if now is None else ("set", path[:2], now)
        self._pending.append((packed, shadow))
        self._recorded += 1
        self._wake.set()

    def set(self, path: tuple, value) -> None:
        self._record(("set", path, value))

    def delete(self, path: tuple) -> None:
        self._record(("del", path))

    def merge(self, path: tuple, mapping: dict) -> None:
        self._record(("merge", path, mapping))

    async def commit(self) -> None:
        """Until every change recorded so far is on disk (``run`` must be running)."""
        target = self._recorded
        while self._durable < target:
            await self._written.wait()

    # -- the writer (worker threads) ------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Group commit: whatever was recorded while the last write ran leaves in the next.

        An I/O error ends this task (and the coordinator with it): after a failed
        fsync nothing is known about what is on disk."""
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                while not self._pending:
                    self._wake = trio.Event()
                    await self._wake.wait()
                batch, self._pending = self._pending, []
                upto = self._recorded
                await trio.to_thread.run_sync(self._append, batch, not self._snapshotting)
                self._durable = upto
                self._written.set()
                self._written = trio.Event()
                if not self._snapshotting and \
                        self._log_bytes > max(self.min_log, self.ratio * self._snap_bytes):
                    self._snapshotting = True
                    await trio.to_thread.run_sync(self._rotate)
                    nursery.start_soon(self._snapshot, self.gen)

    def _append(self, batch: list[tuple], apply_now: bool) -> None:
        records, body, size = [], [], 0
        for c, _ in batch:
            if body and size + len(c) > limits.MAX_METALOG_RECORD:
                records.append(frame(b"".join(body)))
                body, size = [], 0
            body.append(c)
            size += len(c)
        records.append(frame(b"".join(body)))
        data = memoryview(b"".join(records))
        while data:
            n = os.write(self._fd, data)
            data = data[n:]
        os.fsync(self._fd)
        self._log_bytes += sum(len(r) for r in records)
        self._deferred.extend(batch)
        if apply_now:
            for c, shadow in self._deferred:
                apply(self._shadow, shadow or unpack(c), self.packed)
            self._deferred.clear()

    def _rotate(self) -> None:
        """Start the next log; the snapshot of the same generation is written meanwhile."""
        gen = self.gen + 1
        fd = os.open(self._path(gen, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        metafile.fsync_path(self.dir)
        os.close(self._fd)
        self._fd, self.gen, self._log_bytes = fd, gen, 0

    async def _snapshot(self, gen: int) -> None:
        def write():
            n = self._write_snapshot(gen, self._shadow)
            self._remove_before(gen)
            return n
        self._snap_bytes = await trio.to_thread.run_sync(write)
        self._snapshotting = False
        log.info("metadata snapshot %d written (%d bytes)", gen, self._snap_bytes)
