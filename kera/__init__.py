"""kera: stream storage for many small streams, after the KerA virtual-log design.

The packages (``docs/architecture.md`` walks through them): ``cli`` the command line;
``coordinator``, ``broker`` and ``backup`` the three servers; ``kafka`` Kafka's protocol
on every broker; ``recovery`` a dead broker's streamlets brought back; ``vlog`` the
replicated virtual logs; ``security``; ``metrics``; ``wire`` the RPC table and the rows it
carries; ``chunk`` the unit of data; ``sim`` the simulator. Shared by all: ``limits``
(every size limit), ``errors`` (the typed errors), ``frame``, ``rpc`` and ``server``
(transport and admission), ``door``, ``stream_meta``, ``group_positions``, ``cluster``
(``kera up``). The client is ``kera_client`` (``client/``).
"""

__version__ = "0.1.0"
