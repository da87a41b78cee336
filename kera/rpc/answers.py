"""A request's answer as a frame: a result, a typed error, or one given later (``Later``)."""

from __future__ import annotations

import logging

from .. import frame
from ..errors import KeraError
from .writer import parts_frame

log = logging.getLogger("kera.rpc")


class Later:
    """A handler's answer given later, by whoever settles it (``done``), with no task waiting
    for it: the connection writes the answer from there (at once when its socket takes it)."""

    __slots__ = ("_result", "_to")

    def __init__(self):
        self._result = self._to = None

    def done(self, result) -> None:
        """The answer: a result, or an exception (sent as its typed error)."""
        if self._to is not None:
            self._to(result)
        else:
            self._result = (result,)

    def _bind(self, to) -> None:
        if self._result is not None:
            to(self._result[0])
        else:
            self._to = to


def result_frame(rid: int, result) -> bytes | list:
    if result is None:
        result = {}
    if isinstance(result, tuple):
        meta, payload = result
        if isinstance(payload, list):
            return parts_frame(frame.RESPONSE, rid, meta, payload)
        return frame.encode(frame.RESPONSE, rid, meta, payload)
    return frame.encode(frame.RESPONSE, rid, result)


def error_frame(rid: int, err: Exception) -> bytes:
    if isinstance(err, KeraError):
        info = err.to_wire()
    else:
        log.exception("internal error", exc_info=err)
        info = {"code": "internal", "message": f"{type(err).__name__}: {err}"}
    return frame.encode(frame.ERROR, rid, info)
