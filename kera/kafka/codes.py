"""kera's typed errors (``kera.errors``) as the error codes a Kafka client acts on.

The mapping keeps each client's reaction right: a streamlet that moved is
``NOT_LEADER_OR_FOLLOWER`` (the client refreshes its metadata and finds the new owner),
one being recovered is ``LEADER_NOT_AVAILABLE`` (retriable), a full broker or missing
copies ``NOT_ENOUGH_REPLICAS`` (retriable), a position freed by retention
``OFFSET_OUT_OF_RANGE`` (the client resets by its ``auto.offset.reset``).
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from .. import errors

BY_CODE: dict[str, ErrorCode] = {
    errors.NotOwner.code: ErrorCode.not_leader_or_follower,
    errors.Fenced.code: ErrorCode.not_leader_or_follower,
    errors.Recovering.code: ErrorCode.leader_not_available,
    errors.UnknownStream.code: ErrorCode.unknown_topic_or_partition,
    errors.StreamExists.code: ErrorCode.topic_already_exists,
    errors.InvalidName.code: ErrorCode.invalid_topic_exception,
    errors.RecordTooLarge.code: ErrorCode.message_too_large,
    errors.LimitExceeded.code: ErrorCode.invalid_request,
    errors.InvalidArgument.code: ErrorCode.invalid_request,
    errors.ChecksumError.code: ErrorCode.corrupt_message,
    errors.ProtocolError.code: ErrorCode.corrupt_message,
    errors.OutOfOrderSequence.code: ErrorCode.out_of_order_sequence_number,
    errors.UnknownProducer.code: ErrorCode.unknown_producer_id,
    errors.NotEnoughBackups.code: ErrorCode.not_enough_replicas,
    errors.BrokerFull.code: ErrorCode.not_enough_replicas,
    errors.BackupError.code: ErrorCode.not_enough_replicas_after_append,
    errors.Unavailable.code: ErrorCode.request_timed_out,
    errors.NotLeader.code: ErrorCode.request_timed_out,
    errors.DeliveryTimeout.code: ErrorCode.request_timed_out,
    errors.DataLoss.code: ErrorCode.kafka_storage_error,
    errors.OutOfRange.code: ErrorCode.offset_out_of_range,
    errors.Unauthenticated.code: ErrorCode.sasl_authentication_failed,
    errors.AuthenticationFailed.code: ErrorCode.sasl_authentication_failed,
    errors.UnsupportedMechanism.code: ErrorCode.unsupported_sasl_mechanism,
    errors.Unauthorized.code: ErrorCode.topic_authorization_failed,
    errors.ConnectionLimit.code: ErrorCode.request_timed_out,
}


def of(e: BaseException) -> ErrorCode:
    """The Kafka error code for ``e`` (a kera error by its code; anything else is
    ``UNKNOWN_SERVER_ERROR``)."""
    code = getattr(e, "code", None)
    if isinstance(code, str):
        return BY_CODE.get(code, ErrorCode.unknown_server_error)
    return ErrorCode.unknown_server_error


def of_code(code: str | None) -> ErrorCode:
    """The Kafka error code for a kera error code as it travels (``error.code`` strings)."""
    if code is None:
        return ErrorCode.none
    return BY_CODE.get(code, ErrorCode.unknown_server_error)
