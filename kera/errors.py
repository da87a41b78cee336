"""Typed errors shared by servers and clients.

Every error has a stable ``code`` so it can cross the wire in an error frame
and be raised again, as the same class, on the other side.
"""

from __future__ import annotations


class KeraError(Exception):
    code = "error"
    retriable = False

    def to_wire(self) -> dict:
        """Code, message and any public attributes set on the error (e.g. a length)."""
        extra = {k: v for k, v in vars(self).items() if not k.startswith("_")
                 and isinstance(v, (int, str, bool, float))}
        return {**extra, "code": self.code, "message": str(self)}


class ProtocolError(KeraError):
    """Malformed frame or request: the connection is closed after it."""

    code = "protocol"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class ChecksumError(KeraError):
    code = "checksum"


class InvalidName(KeraError):
    code = "invalid_name"


class InvalidArgument(KeraError):
    code = "invalid_argument"


class LimitExceeded(InvalidArgument):
    """A size or count over one of ``kera.limits``: ``limit`` names it, ``bound`` is its
    value and ``size`` what was asked, so the caller knows what to change."""

    code = "limit_exceeded"

    def __init__(self, message: str = "", *, limit: str = "", bound: int = 0, size: int = 0):
        super().__init__(message)
        self.limit, self.bound, self.size = limit, bound, size


class RecordTooLarge(LimitExceeded):
    """A record (or the chunk holding it) larger than the largest chunk the stream takes:
    min(MAX_CHUNK, the stream's segment size). Refused before anything is stored."""

    code = "record_too_large"


class UnknownStream(KeraError):
    code = "unknown_stream"


class StreamExists(KeraError):
    code = "stream_exists"


class UnknownMethod(KeraError):
    code = "unknown_method"


class NotOwner(KeraError):
    """The streamlet lives elsewhere now (moved, deleted or being recovered)."""

    code = "not_owner"
    retriable = True


class Recovering(KeraError):
    code = "recovering"
    retriable = True


class Fenced(KeraError):
    """The server's generation is older than the coordinator's: it must not serve."""

    code = "fenced"
    retriable = True


class UnknownMember(KeraError):
    """The coordinator does not know this server (it restarted): register again, same epoch."""

    code = "unknown_member"
    retriable = True


class OutOfOrderSequence(KeraError):
    code = "out_of_order_sequence"
    retriable = True


class UnknownProducer(KeraError):
    """A producer's first chunk on a streamlet (as far as its broker knows) does not start
    its sequence: at 0, or flagged ``SEQ_RESET`` (Kafka's UNKNOWN_PRODUCER_ID). Its producer
    sends it again flagged ``SEQ_RESET``: everything before it was acknowledged or given up."""

    code = "unknown_producer"
    retriable = True


class NotEnoughBackups(KeraError):
    code = "not_enough_backups"
    retriable = True


class BrokerFull(KeraError):
    """The broker's memory budget is spent: no new segment can be allocated."""

    code = "broker_full"


class BackupError(KeraError):
    """A backup could not store a replica (I/O error, full disk, bad offset)."""

    code = "backup"
    retriable = True


class Unavailable(KeraError):
    """A connection failed or timed out; the caller may retry elsewhere."""

    code = "unavailable"
    retriable = True


class DeliveryTimeout(KeraError):
    """A producer gave up on a record not acknowledged within its ``delivery.timeout.ms``:
    it may or may not be stored (an acknowledgement may have been lost)."""

    code = "delivery_timeout"


class Conflict(KeraError):
    """A conditional append found the streamlet changed since the caller's ``tail`` token."""

    code = "conflict"


class NotLeader(Unavailable):
    """This coordinator stands by: ``leader`` names the one that leads ("" when unknown)."""

    code = "not_leader"

    def __init__(self, message: str = "", *, leader: str = ""):
        super().__init__(message)
        self.leader = leader


class DataLoss(KeraError):
    """Data that must come before this request's bytes is missing on every copy.

    A recovering broker refuses a chunk whose placement would leave a hole in
    its group: the chunks before it were lost, and storing it would hide that.
    """

    code = "data_loss"


class UnknownSession(KeraError):
    """A pull session the broker does not hold (it restarted, or the session expired or was
    evicted): the reader opens a new one, naming its streamlets again."""

    code = "unknown_session"


class OutOfRange(KeraError):
    """A reader's position is before the start of what is retained (expired or deleted
    segments): it may restart from the earliest retained position (Kafka's
    ``auto.offset.reset``). ``starts`` (when sent) maps each retained group to its first
    position and ``first`` is the lowest group still held."""

    code = "out_of_range"


class Unauthenticated(KeraError):
    """The connection has not proved who it is (no handshake, or not as what this request
    needs): authenticate first (``kera.security``)."""

    code = "unauthenticated"


class AuthenticationFailed(Unauthenticated):
    """A handshake failed: a wrong password or proof, an unknown user. The connection closes."""

    code = "authentication_failed"


class UnsupportedMechanism(Unauthenticated):
    """A handshake named a mechanism this server does not take (or not on this listener:
    PLAIN only over TLS); ``mechanisms`` lists those it takes."""

    code = "unsupported_mechanism"


class Unauthorized(KeraError):
    """The connection is authenticated, but its principal may not do this (an ACL, a member
    of another role, or a member speaking for another)."""

    code = "unauthorized"


class ConnectionLimit(Unavailable):
    """A listener's cap on connections (in all, or from one address) is reached: the new
    connection is told so and closed; retry later or elsewhere."""

    code = "connection_limit"

    def __init__(self, message: str = "", *, limit: str = "", bound: int = 0):
        super().__init__(message)
        self.limit, self.bound = limit, bound


class Internal(KeraError):
    """A server failed unexpectedly on a request (its message says how): the same request may
    succeed when it is tried again."""

    code = "internal"
    retriable = True


class PeerTooSlow(KeraError):
    """A connection was cut for holding resources: idle past the idle timeout, a frame not
    finished within the read timeout, or replies queued past their byte budget (a peer
    that does not read)."""

    code = "peer_too_slow"


_BY_CODE = {
    cls.code: cls
    for cls in [
        KeraError, ProtocolError, FrameTooLarge, ChecksumError, InvalidName, InvalidArgument,
        LimitExceeded, RecordTooLarge, UnknownStream, StreamExists, UnknownMethod, NotOwner, Recovering, Fenced,
        OutOfOrderSequence, UnknownProducer, UnknownMember, NotEnoughBackups, BrokerFull, BackupError, Unavailable, NotLeader,
        DataLoss, Conflict, OutOfRange, DeliveryTimeout, Unauthenticated, AuthenticationFailed,
        UnsupportedMechanism, Unauthorized, ConnectionLimit, PeerTooSlow, Internal,
    ]
}
# the codes of errors that may pass (a moved owner, a recovery, a dead connection): a client
# tries again what was refused with one of them
RETRIABLE = frozenset(code for code, cls in _BY_CODE.items() if cls.retriable)


def from_wire(info: dict) -> KeraError:
    code = info.get("code")
    cls = _BY_CODE.get(code, KeraError)
    err = cls(info.get("message", ""))
    if cls is KeraError and isinstance(code, str):
        err.code = code  # a code this side does not know still reads as itself
    for k, v in info.items():
        if k not in ("code", "message"):
            setattr(err, k, v)
    return err
