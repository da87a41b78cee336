"""Asking the backups for the index of a dead broker's settled vsegs (``index``).

The re-pointing (``kera.recovery.repoint``) plans from rows, a row per chunk or per run of
a producer's chunks, that each vseg's backups list from their copies' headers without
the bodies; the dead broker's own index chunks come whole. A vseg is asked of one of its
whole copies' backups (spread over them), many vsegs a call; what fails there (the
backup, or its answer for that vseg) is asked of its next copy in the next round, and a
vseg no copy could index ends its vlog's settled prefix. Decoding is apart from asking:
an answer that does not add up is a ``ProtocolError`` for that vseg alone.
"""

from __future__ import annotations

import logging

import numpy as np
import trio

from .. import chunk, limits
from ..errors import InvalidArgument, KeraError, ProtocolError
from ..wire.columns import INDEX_COLUMNS, IX_COUNT, IX_FLAGS, IX_VOFF
from . import index_chunk
from .repoint_plan import LAST, answer_rows

log = logging.getLogger("kera.recovery")

INDEX_TIMEOUT = 30.0
ANSWER = INDEX_COLUMNS   # u64s per chunk in an index answer (one more, the count, per run of
# chunks in an answer of runs): the rows' columns VOFF..FLAGS


def _bad_runs(a: np.ndarray, runs: bool) -> np.ndarray:
    """Rows whose count cannot be: none, or several chunks with a flag (never joined)."""
    if not runs:
        return np.zeros(len(a), bool)
    return (a[:, IX_COUNT] == 0) | ((a[:, IX_COUNT] != 1) & (a[:, IX_FLAGS] != 0))


class _Gathered:
    """What the backups' index answers gave so far: rows (arrays of (n, COLUMNS)), and the
    index chunks by (vlog, vseg, offset). Decoding only: a bad answer raises, its caller
    asks another copy."""

    def __init__(self):
        self.answers: list[np.ndarray] = []
        self.indexes: dict[tuple[int, int, int], bytes] = {}

    def vseg(self, vlog: int, vseg: int, runs: bool, data: memoryview, rows: int) -> None:
        """One vseg's answer: its rows, then its index chunks (verified)."""
        found = chunk.scan(data[rows:])
        a = np.frombuffer(data[:rows], "<u8").reshape(-1, ANSWER + runs)
        marks = np.flatnonzero(a[:, IX_FLAGS] & chunk.INDEX)
        if len(marks) != len(found):
            raise ProtocolError(f"{len(marks)} index rows but {len(found)} index chunks")
        if _bad_runs(a, runs).any():
            raise ProtocolError("a run of no chunk, or of several with a flag")
        out = answer_rows(a, vlog, vseg, runs)
        for i, (h, off) in zip(marks.tolist(), found, strict=True):  # an index chunk covers a run
            data_i = bytes(data[rows + off:rows + off + h.size])
            out[i, LAST] += len(index_chunk.parse(data_i, h).counts) - 1
            self.indexes[(vlog, vseg, int(a[i, IX_VOFF]))] = data_i
        self.answers.append(out)

    def plain(self, b: int, got: list, failed: list, runs: bool) -> None:
        """Answers holding rows only (no index chunk), decoded together: one array for the
        batch, not a few per vseg; one with a row flagged INDEX is a bad answer (``failed``)."""
        if not got:
            return
        width = ANSWER + runs
        a = np.frombuffer(b"".join(part for _, part in got), "<u8").reshape(-1, width)
        counts = [len(part) // (8 * width) for _, part in got]
        which = np.repeat(np.arange(len(got)), counts)
        good = np.ones(len(got), bool)
        for k in set(which[(a[:, IX_FLAGS] & chunk.INDEX != 0) | _bad_runs(a, runs)].tolist()):
            vlog, vseg, *_ = item = got[k][0]
            log.warning("index of vlog %d vseg %d on backup %d: index rows but no index chunks, or a "
                        "run of no chunk or of several with a flag", vlog, vseg, b)
            failed.append(item)
            good[k] = False
        out = answer_rows(a, np.repeat([item[0] for item, _ in got], counts),
                          np.repeat([item[1] for item, _ in got], counts), runs)
        self.answers.append(out if good.all() else out[good[which]])


def _part(e, first: bool, data: memoryview, at: int) -> memoryview | None:
    """One vseg's entry ``e`` of an index answer whose bytes start at ``at`` of ``data``: its
    bytes, or None if put off (asked again later); raises if it is malformed or an error
    (``first``: the first vseg asked, which is never put off)."""
    if not isinstance(e, dict):
        raise ProtocolError(f"answer {e!r} is not a map")
    if e.get("later"):
        if first:
            raise ProtocolError("the first vseg asked was put off")
        return None
    if "error" in e:
        raise KeraError(f"{e['error']}: {e.get('message')}")
    n = e["bytes"]
    if not isinstance(n, int) or not 0 <= n <= len(data) - at:
        raise ProtocolError(f"bytes {n!r} past the payload")
    return data[at:at + n]


def _rows(e: dict, part: memoryview, runs: bool) -> int:
    """How many bytes of an entry's ``part`` are rows (the rest: its index chunks)."""
    rows = e["rows"]
    if not isinstance(rows, int) or not 0 <= rows <= len(part) or rows % (8 * (ANSWER + runs)):
        raise ProtocolError(f"rows {rows!r} is not a whole number of rows in the answer")
    return rows


def _vseg(vlog: int, vseg: int, runs: bool, verify: bool) -> list:
    """How a vseg is named in an ``index`` request: [vlog, vseg, runs of chunks?, verified?]."""
    return [vlog, vseg, runs, True] if verify else [vlog, vseg, True] if runs else [vlog, vseg]


async def _ask(pool, addr: str, broker: int, batch: list) -> tuple[list, memoryview]:
    """One ``index`` call for ``batch``: one answer per vseg asked, and the payload."""
    meta, payload = await pool.call(addr, "index", {
        "broker": broker, "vsegs": [_vseg(v, s, runs, verify) for v, s, runs, verify, _ in batch]},
        timeout=INDEX_TIMEOUT)
    data = memoryview(b"".join(payload) if isinstance(payload, list) else bytes(payload))
    entries = meta["answers"]
    if not isinstance(entries, list) or len(entries) != len(batch):
        raise ProtocolError("one answer per vseg asked")
    return entries, data


async def _ask_backup(pool, broker: int, b: int, addrs: dict, items: list, failed: list,
                      got: _Gathered) -> None:
    """The index of ``items`` on backup ``b``, ``limits.INDEX_VSEGS`` vsegs a call, into ``got``; what
    fails there goes to ``failed``, for the next copy."""
    while items:
        batch, items = items[:limits.INDEX_VSEGS], items[limits.INDEX_VSEGS:]
        try:
            entries, data = await _ask(pool, addrs[b], broker, batch)
        except InvalidArgument as e:
            if any(runs for _, _, runs, _, _ in batch):   # a backup that answers no runs: per chunk
                log.info("index of %d vsegs on backup %d: %s; asking for chunks' rows", len(batch), b, e)
                items = [(v, s, False, verify, rest) for v, s, _, verify, rest in batch] + items
                continue
            log.warning("index of %d vsegs on backup %d: %s", len(batch), b, e)
            failed += batch
            continue
        except (KeraError, KeyError, TypeError) as e:
            log.warning("index of %d vsegs on backup %d: %s", len(batch), b, e)
            failed += batch
            continue
        at = 0
        plain: tuple[list, list] = ([], [])   # (item, its rows): answers without index chunks
        for i, (item, e) in enumerate(zip(batch, entries, strict=True)):
            vlog, vseg, runs, *_ = item
            try:
                part = _part(e, i == 0, data, at)
                if part is None:
                    items.append(item)
                    continue
                at += len(part)   # the next answer's bytes start here either way
                rows = _rows(e, part, runs)
                if rows == len(part):
                    plain[runs].append((item, part))
                else:
                    got.vseg(vlog, vseg, runs, part, rows)
            except (KeraError, KeyError, TypeError, AttributeError) as err:
                log.warning("index of vlog %d vseg %d on backup %d: %s", vlog, vseg, b, err)
                failed.append(item)
        got.plain(b, plain[False], failed, False)
        got.plain(b, plain[True], failed, True)


async def index(pool, broker: int, addrs: dict, vsegs: list):
    """Ask the backups for the index of ``vsegs`` ([(vlog, vseg, backups holding it whole,
    as runs of chunks or not, bodies verified first or not)]): each of one of its copies'
    backups (spread over them), in batches; one that fails there is asked of its next copy,
    in the next round. Returns the rows (arrays of (n, COLUMNS)), the index chunks by (vlog,
    vseg, offset), and per vlog the first vseg no copy could index."""
    got = _Gathered()
    cut: dict[int, int] = {}
    todo: dict[int, list] = {}
    for vlog, vseg, backups, runs, verify in vsegs:
        k = vseg % len(backups)
        todo.setdefault(backups[k], []).append((vlog, vseg, runs, verify, backups[k + 1:] + backups[:k]))
    while todo:
        failed: dict[int, list] = {}
        async with trio.open_nursery() as n:
            for b, items in todo.items():
                failed[b] = []
                n.start_soon(_ask_backup, pool, broker, b, addrs, items, failed[b], got)
        todo = {}
        for items in failed.values():
            for vlog, vseg, runs, verify, rest in items:
                if rest:
                    todo.setdefault(rest[0], []).append((vlog, vseg, runs, verify, rest[1:]))
                else:
                    cut[vlog] = min(cut.get(vlog, vseg), vseg)
    return got.answers, got.indexes, cut
