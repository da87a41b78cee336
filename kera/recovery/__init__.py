"""Recovery: a dead broker's streamlets brought back from the backups (coordinator side).

- ``manager``: ``RecoveryManager``, which drives each recovery through its phases;
  ``state``: one recovery's ``State`` and figures (what ``kera status`` shows).
- ``needs``: the shapes of what the coordinator hands recovery (``Liveness``,
  ``MetaStore``, ``Owners``, ``RecoveredList``, ``Settings``): it never sees the coordinator.
- ``listing``: what the backups hold of a dead broker (``list``).
- ``plan``: which copy each chunk of a dead incarnation's virtual logs is replayed from
  (sans-IO; also driven by ``kera.sim``).
- ``repoint_plan``: which settled segments a new owner takes as evicted instead of
  replaying them (sans-IO); ``repoint`` carries it out (adopt, replay the rest), asking
  the backups for the settled vsegs' rows through ``indexing``.
- ``index_chunk``: the format of the index chunks that hand a run of segments over.
- ``adoption``: ``Adoptions``, closed history adopted after the streamlets serve again.
- ``holdings``: which incarnation owns which streamlets, indexed for a dead one's lookup.
- ``routes``: a replay's routes, packed as rows.

The parts on the other servers: ``kera.broker.takeover`` and ``kera.broker.adopted`` (a new
owner), ``kera.backup.readback`` and ``kera.backup.replay`` (the copies read and pushed).
"""
