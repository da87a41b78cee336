"""A stream as a client sees it: its metadata plus where each streamlet is served.

The coordinator answers ``metadata``, ``describe_stream`` and ``list_streams``
with a stream's map and ``addrs``, the address of each streamlet's owner
(None while it is being recovered). Clients keep this typed view and fetch
it again when an owner moves (``NotOwner``, a dead address); the map is read
only here.
"""

from __future__ import annotations

import dataclasses

from kera.errors import InvalidArgument
from kera.stream_meta import StreamMeta


@dataclasses.dataclass(slots=True)
class StreamView(StreamMeta):
    addrs: tuple[str | None, ...] = ()   # streamlet i is served at addrs[i]; None: being recovered

    @classmethod
    def _more_from_wire(cls, d: dict) -> tuple:
        addrs = d.get("addrs")
        if not isinstance(addrs, list) or len(addrs) != d["streamlets"] or \
                not all(a is None or isinstance(a, str) for a in addrs):
            raise InvalidArgument("stream metadata: addrs must be a list of an address (or None) "
                                  "per streamlet")
        return (tuple(addrs),)

    def to_wire(self) -> dict:
        d = StreamMeta.to_wire(self)
        d["addrs"] = list(self.addrs)
        return d


StreamView.WIRE_KEYS = StreamMeta.WIRE_KEYS | {"addrs"}
