"""The transport: frames between clients and servers over TCP, in the clear or through TLS.

- ``channel``: a connection's bytes, ``Plain`` or ``Tls`` (an ``ssl.SSLObject`` driven on
  the socket directly), and a frame on its way to the socket.
- ``writer``: ``FrameWriter``, a connection's sending side (one frame at a time, written
  from wherever it was made; the door's send deadline and reply budget).
- ``answers``: a request's answer as a frame, and ``Later``, an answer given by whoever
  settles it.
- ``connection``: one pipelined client connection; ``pool``: a client's connections by
  address, each authenticated once when it opens.
- ``served``: one connection of a server, its requests admitted and answered in order.
- ``addresses``: ``HOST:PORT`` and the address a server is reached at.

The sans-IO frame codec is ``kera.frame``; a server's table of RPCs ``kera.wire``; its door
``kera.door``; the base of every server ``kera.server``. The names the rest of kera uses
are these:
"""

from .addresses import advertised, parse_addr
from .answers import Later, error_frame, result_frame
from .pool import Pool, open_pool, unwrapped
from .writer import send_frame

__all__ = ["Later", "Pool", "advertised", "error_frame", "open_pool", "parse_addr",
           "result_frame", "send_frame", "unwrapped"]
