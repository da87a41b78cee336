"""Security: who may connect, who they are, and what they may do.

- ``secret``: the cluster secret (a file, mode 0600) and the keys derived from it.
- ``mechanisms``: the handshakes, sans-IO: ``KERA-MEMBER`` (members prove the cluster
  secret, mutually), SCRAM-SHA-256/512 and PLAIN (users).
- ``acl``: Kafka-shaped ACLs and the ``Authorizer`` (deny wins, super users bypass).
- ``gate``: a server's ``Gate`` (mechanisms offered, users and ACLs held, producer-id
  tokens) and a connection's ``Peer`` (its identity and cached decisions).
- ``credentials``: what a client pool presents when it opens a connection.

Which RPC needs which caller is the wire table's (``kera.wire``); the transport
(``kera.server``) admits each request from it before its handler runs.
"""
