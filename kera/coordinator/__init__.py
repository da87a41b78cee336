"""The coordinator: membership, stream metadata, failure detection, recovery orchestration.

- ``service``: ``Coordinator`` (its RPCs, placement, leadership) and ``main``.
- ``membership``: who is alive, at which epoch, who is declared dead (soft state).
- ``catalog``: the streams as the store keeps them (packed maps; name, id and owner indexes).
- ``metalog``: the embedded store, an append-only checksummed log of changes plus snapshots.
- ``etcd_store``: the same metadata in etcd, and the election of the coordinator that leads.
- ``etcd``: a small etcd v3 client over its JSON gateway, and a local etcd server.
- ``recovered``: dead incarnations whose files every backup may let go.
- ``link``: calls to whichever coordinator leads, used by every server and client.

The recoveries the coordinator drives live in ``kera.recovery``. Nothing is imported here,
so a client importing ``kera.coordinator.link`` loads only that.
"""
