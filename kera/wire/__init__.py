"""The wire: every RPC of every server, its fields, who may call it, and the rows it carries.

- ``table``: the RPC table: per server, each RPC's caller and request fields (``Rpc``),
  admitted before any handler runs; ``TABLES`` by role.
- ``fields``: the field types (``Spec``), their bounds and the typed errors they raise.
- ``columns``: the column layouts of rows of u64s that backups write and recovery reads.

The table's names are handed on here (``wire.COORDINATOR_RPCS``, ``wire.Rpc``).
"""

from .fields import ADDR, ANY, U63, UINT, Spec
from .table import (
    ANYONE,
    AUTHENTICATED,
    BACKUP_RPCS,
    BROKER_RPCS,
    COORDINATOR_RPCS,
    TABLES,
    Anyone,
    Authenticated,
    Caller,
    Client,
    Members,
    Rpc,
    named,
)

__all__ = ["ADDR", "ANY", "ANYONE", "AUTHENTICATED", "BACKUP_RPCS", "BROKER_RPCS", "COORDINATOR_RPCS",
           "TABLES", "U63", "UINT", "Anyone", "Authenticated", "Caller", "Client", "Members", "Rpc",
           "Spec", "named"]
