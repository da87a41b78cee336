"""A broker's Kafka gateway: its listener, and the handlers of the APIs it serves.

Composed into ``BrokerService`` (``--kafka-listener``): it reads the broker's streamlets,
appends to them and waits on their virtual logs exactly as the broker's own produce and
pull do, asks the coordinator what the coordinator knows (where topics live, new topics,
producer ids), and coordinates the consumer groups whose positions' streamlet this
broker owns (``groups``). With ``--auth`` a connection authenticates first
(SaslHandshake, SaslAuthenticate with the cluster's SCRAM users) and every request is
judged by the same ACLs as kera's own.
"""

from __future__ import annotations

import trio
from kio.schema.errors import ErrorCode

from ..errors import AuthenticationFailed, KeraError, Unauthenticated
from ..rpc import advertised
from . import fetch, groups, metadata, produce, versions
from .listener import KafkaListener

# what a connection may ask before it authenticates (with --auth)
OPEN = frozenset(("api_versions", "sasl_handshake", "sasl_authenticate"))


class Gateway:
    def __init__(self, broker, listen: str, advertise: str = ""):
        host, _, port = listen.rpartition(":")
        self.broker = broker
        self.host, self.port = host or "127.0.0.1", int(port or 0)
        self.advertise = advertise
        self.addr = ""
        self.auto_create = True        # Kafka's auto.create.topics.enable (num.partitions 1)
        self.groups = groups.Coordinator(self)
        handlers = {"_gate": self._gate, "api_versions": self.api_versions,
                    "sasl_handshake": self.sasl_handshake,
                    "sasl_authenticate": self.sasl_authenticate}
        for module in (metadata, produce, fetch, groups):
            handlers.update(module.handlers(self))
        self.listener = KafkaListener(broker, handlers)
        # what Kafka clients asked (per request and per batch, never per record)
        self.counts = {"produce_requests": 0, "produce_batches": 0, "fetch_requests": 0,
                       "fetch_partitions": 0, "fetch_batches": 0}

    def stats(self) -> dict:
        return {"requests": self.listener.requests, "dropped": self.listener.dropped,
                "connections": self.listener.connections, **self.counts}

    async def run(self, pool, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve Kafka clients (started once the broker's own listener is bound)."""
        async with trio.open_nursery() as n:
            bound = await n.start(self.listener.serve, self.host, self.port)
            self.addr = self.listener.addr = advertised(self.host, bound, self.advertise)
            print(f"kafka listener on {self.addr}", flush=True)
            n.start_soon(self.groups.run)
            task_status.started(bound)

    async def coordinator(self, method: str, meta: dict) -> dict:
        r, _ = await self.broker.coord.call(method, meta, timeout=10)
        return r

    # -- the gate and the handshake ----------------------------------------------------
    def _gate(self, conn, name: str) -> None:
        if conn.peer.role is None and name not in OPEN:
            raise Unauthenticated(f"{name} before authenticating: SaslHandshake first")

    def api_versions(self, conn, req, version):
        return versions.api_versions_body(version)

    def sasl_handshake(self, conn, req, version):
        gate = self.broker.gate
        offered = [m for m in gate.mechanisms(conn.peer) if m != "KERA-MEMBER"]
        try:
            conn.sasl = gate.mechanism(req.mechanism, conn.peer)
            if req.mechanism not in offered:
                raise KeraError("not offered")
            code = ErrorCode.none
        except KeraError:
            conn.sasl = None
            code = ErrorCode.unsupported_sasl_mechanism
        return {"error_code": code, "mechanisms": offered}

    def sasl_authenticate(self, conn, req, version):
        if conn.sasl is None:
            return {"error_code": ErrorCode.illegal_sasl_state,
                    "error_message": "SaslHandshake first", "auth_bytes": b""}
        try:
            out, who = conn.sasl.step(req.auth_bytes)
        except AuthenticationFailed as e:
            conn.sasl = None
            self.broker.door.stats["auth_failed"] += 1
            return {"error_code": ErrorCode.sasl_authentication_failed, "error_message": str(e),
                    "auth_bytes": b""}
        if who is not None:
            conn.sasl = None
            conn.peer.authenticated(who)
        return {"error_code": ErrorCode.none, "auth_bytes": out, "session_lifetime": 0}
