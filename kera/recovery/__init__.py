"""Recovery: a dead broker's streamlets brought back from the backups (coordinator side).

- ``manager``: ``RecoveryManager``, which drives each recovery through its phases.
- ``plan``: which copy each chunk of a dead incarnation's virtual logs is replayed from
  (sans-IO; also driven by ``kera.sim``).
- ``repoint_plan``: which settled segments a new owner takes as evicted instead of
  replaying them (sans-IO); ``repoint`` carries it out (index, adopt, replay the rest).
- ``index_chunk``: the format of the index chunks that hand a run of segments over.
- ``adoption``: closed history adopted after the streamlets serve again.
- ``holdings``: which incarnation owns which streamlets, indexed for a dead one's lookup.
- ``routes``: a replay's routes, packed as rows.

The parts on the other servers: ``kera.broker.takeover`` and ``kera.broker.adopted`` (a new
owner), ``kera.backup.readback`` and ``kera.backup.replay`` (the copies read and pushed).
"""
