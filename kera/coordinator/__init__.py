"""The coordinator: membership, stream metadata, failure detection, recovery orchestration.

- ``service``: ``Coordinator``, the RPC face and its terms: each term composes the parts
  below afresh, each handed what it needs of the others (never the coordinator).
- ``main``: the process: its command line, the parts composed, the metrics beside.
- ``metadata``: one term's store, the streams' catalog, and the changes made through them.
- ``membership``: ``Roster``, who is alive, at which epoch, who is declared dead (soft state).
- ``streams``: ``StreamAdmin``, the streams' RPCs (create, alter, delete, list, locate);
  ``specs`` checks a stream's spec; ``placement`` picks its owners and tells them.
- ``recovered``: dead incarnations whose files every backup may let go.
- ``catalog``: the streams as the store keeps them (packed maps; name, id and owner indexes).
- ``metalog``: the embedded store, an append-only checksummed log of changes plus snapshots.
- ``etcd_store``: the same metadata in etcd, and the election of the coordinator that leads.
- ``etcd``: a small etcd v3 client over its JSON gateway, and a local etcd server.
- ``link``: calls to whichever coordinator leads, used by every server and client.

The recoveries the coordinator drives live in ``kera.recovery``, handed the parts by the
shapes ``kera.recovery.needs`` names. Nothing is imported here, so a client importing
``kera.coordinator.link`` loads only that.
"""
