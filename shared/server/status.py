"""The one table from typed errors (`pdserve.errors`) to gRPC status codes, so every service answers alike."""

from __future__ import annotations

import grpc

from pdserve.errors import (
    CorruptPage,
    DeadlineExceeded,
    DuplicateRequest,
    InvalidRequest,
    OutOfPages,
    PeerUnavailable,
    TransferError,
    TransportUnusable,
    UnknownRequest,
)

# Most specific class first: the first entry the error is an instance of decides.
STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (CorruptPage, grpc.StatusCode.DATA_LOSS),
    (TransferError, grpc.StatusCode.DATA_LOSS),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TransportUnusable, grpc.StatusCode.FAILED_PRECONDITION),
    (PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (OutOfPages, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def engine_error_code(err: BaseException) -> grpc.StatusCode:
    """The status for `err`: its typed class from STATUS_OF; an untyped error is ours → INTERNAL."""
    for cls, code in STATUS_OF:
        if isinstance(err, cls):
            return code
    return grpc.StatusCode.INTERNAL
