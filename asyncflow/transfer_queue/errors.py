"""Exceptions raised by TransferQueue clients.

Servers never raise across the wire: they reply with an error code and a message, and the client maps
the code back to one of these classes so that callers can catch precise failures.
"""

from __future__ import annotations


class TransferQueueError(RuntimeError):
    """Base class of every TransferQueue error."""

    code = "error"


class BadRequestError(TransferQueueError, ValueError):
    """The request was invalid (unknown field or partition, wrong dtype or shape, double write...).
    Nothing was changed."""

    code = "bad_request"


class AlreadyWrittenError(BadRequestError):
    """A put names rows in which one of its fields is already written (fields are write-once). A consumer that
    processes rows again after a restart meets it for the rows its dead predecessor wrote."""

    code = "already_written"


class WritePendingError(BadRequestError):
    """A put names rows that another put, prepared and not yet committed, is writing the same field of (it
    commits, or rolls back after ``put_lease_s`` when its writer died)."""

    code = "write_pending"


class RowsClearedError(BadRequestError):
    """A request names rows that were cleared: read by every consumer task of an auto-clearing partition, or dropped
    by a clear. A worker that makes again the rows a dead predecessor put meets it once those rows were trained."""

    code = "rows_cleared"


class UnknownPartitionError(BadRequestError, KeyError):
    """The partition does not exist (never created, or already cleared)."""

    code = "unknown_partition"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


class TransferQueueTimeoutError(TransferQueueError, TimeoutError):
    """A blocking request ran out of time; the message says what was missing."""

    code = "timeout"


class BackPressureError(TransferQueueTimeoutError):
    """A put waited for capacity (rows or bytes) longer than its timeout."""

    code = "backpressure"


class StorageUnitError(TransferQueueError):
    """A storage unit died or stopped answering; rows it held are lost."""

    code = "storage"


class StalePutError(TransferQueueError):
    """A write or commit of a put that was already rolled back (its lease expired, its writer or a
    force clear aborted it): nothing of it is visible, and its ranges may already hold other rows."""

    code = "stale"


class ReadCancelledError(TransferQueueError):
    """A get of a reader declared dead (``cancel_reads``): it was dropped from the controller's waiting room, or
    refused because its client is the one declared dead; no rows were handed out to it."""

    code = "cancelled"


class ServerUnavailableError(TransferQueueError):
    """The controller or a storage unit did not answer within the RPC timeout."""

    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[TransferQueueError]] = {
    cls.code: cls
    for cls in (TransferQueueError, BadRequestError, AlreadyWrittenError, WritePendingError, RowsClearedError,
                UnknownPartitionError, TransferQueueTimeoutError,
                BackPressureError, StorageUnitError, StalePutError, ReadCancelledError,
                ServerUnavailableError)
}


def error_from_reply(code: str, message: str) -> TransferQueueError:
    """Rebuild the exception a server reported."""
    return ERRORS_BY_CODE.get(code, TransferQueueError)(message)
