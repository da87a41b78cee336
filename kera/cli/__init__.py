"""The ``kera`` command, a module per group of commands.

- ``main``: the parser put together from the modules below, and the command run.
- ``options``: what every client command takes (``--coordinator``, ``--config``) and how
  it runs (a ``KeraError`` printed, exit 1).
- ``servers``: ``kera up`` (a local cluster) and ``kera coordinator|broker|backup`` (one
  server process, composed here: the coordinator is handed the client's reader).
- ``streams``: ``kera stream create|list|describe|alter|delete``.
- ``records``: ``kera produce`` and ``kera consume``.
- ``status``: ``kera status``, ``kera recovery``, and ``kera top`` (drawn by ``top``).
- ``kv``: ``kera kv``, the linearizable map; ``access``: ``kera user`` and ``kera acl``.

The command line depends on the client (``kera_client``), never the reverse.
"""

from .main import main

__all__ = ["main"]
