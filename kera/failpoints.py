"""Failpoints: named places where a process can be told, at start, to fail or to pause.

Some windows of the recovery are too short to hit from outside by killing a
process at the right moment (a few milliseconds between two RPCs). A test
names such a place in ``KERA_FAILPOINTS`` (read once, when the process
starts; unset, every failpoint is a dictionary lookup that finds nothing),
as ``name=action`` pairs separated by ``;``:

- ``error`` or ``N*error``: the first (N) hits raise ``FailpointError``;
  later hits pass.
- ``pause(PATH)``: the first hit creates PATH (holding what the place tells,
  e.g. the address of the process it was talking to) and waits until it is
  removed, so a test waits for the file, does what it needs at that exact
  point (kill -9 a process, restart another), then removes it.

The places are listed in ``POINTS``; an unknown name or action fails the
process at start, so a test cannot name a place that does not exist.
"""

from __future__ import annotations

import os
import re

import trio

from .errors import KeraError

POINTS = {
    # kera.recovery.adoption: a pending adoption is about to start (its owners' streamlets serve,
    # told by the recovery which groups are still to come)
    "adoption.start",
    # kera.recovery.adoption (through kera.recovery.repoint's settle): after a hand-over, an owner adopted the
    # dead broker's closed groups and has not yet been asked to settle (make them durable
    # and claimed); its streamlets serve, those groups still pending
    "adoption.adopted",
    # kera.recovery.repoint: a recovery planned from runs of chunks asks for the chunks' own rows of the
    # segments it adopts before the replay (an error: as if no copy answered)
    "repoint.chunk_rows",
    # kera.recovery.manager: a recovery replayed what its new owners were assigned and is about
    # to hand them over (the streams they were given by map are named by id there)
    "recovery.handover",
}
PAUSE_POLL = 0.01

_ACTION = re.compile(r"^(?:(\d+)\*)?error$|^pause\((.+)\)$")


class FailpointError(KeraError):
    code = "failpoint"
    retriable = True


def parse(spec: str) -> dict[str, list]:
    """``name=action;...`` -> name -> [hits left, pause path or None]."""
    out: dict[str, list] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, action = part.partition("=")
        m = _ACTION.match(action.strip())
        if name not in POINTS or m is None:
            raise ValueError(f"KERA_FAILPOINTS: {part!r} is not one of {sorted(POINTS)} = "
                             "error, N*error or pause(PATH)")
        out[name] = [1, m.group(2)] if m.group(2) else [int(m.group(1) or 1), None]
    return out


_armed = parse(os.environ.get("KERA_FAILPOINTS", ""))


async def hit(name: str, detail: str = "") -> None:
    """Fail or pause here if the process was started with ``name`` armed; a pause writes
    ``detail`` (what the test may act on, e.g. an address) into its file."""
    armed = _armed.get(name)
    if armed is None or armed[0] <= 0:
        return
    armed[0] -= 1
    if armed[1] is None:
        raise FailpointError(f"failpoint {name}")
    path = armed[1]
    with open(path + ".tmp", "w") as f:
        f.write(detail)
    os.replace(path + ".tmp", path)   # whole when it appears
    while os.path.exists(path):
        await trio.sleep(PAUSE_POLL)
