"""Map engine exceptions to gRPC status codes (one place, so every service answers alike)."""
from __future__ import annotations

import grpc

from pdserve.engine.page_table import OutOfPages


def engine_error_code(err: BaseException) -> grpc.StatusCode:
    """OutOfPages → RESOURCE_EXHAUSTED (retry later / elsewhere); duplicate id → ALREADY_EXISTS;
    other ValueError → INVALID_ARGUMENT (bad input); anything else → INTERNAL."""
    if isinstance(err, OutOfPages):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(err, ValueError):
        return grpc.StatusCode.ALREADY_EXISTS if "duplicate request id" in str(err) else \
            grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL
