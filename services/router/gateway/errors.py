"""OpenAI-shaped errors: the router's gRPC status → HTTP status, and the `{"error": {...}}` body."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from pdserve.router.servicer import RETRY_AFTER_KEY

# gRPC status → (HTTP status, OpenAI error type); anything else is a 500 server_error
HTTP_OF: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
}


class APIError(Exception):
    """An error the gateway answers itself (bad request body, unsupported parameter, unknown model)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def api_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


def retry_after_s(e: grpc.RpcError) -> int | None:
    """Whole seconds (rounded up, at least 1) from the router's `retry-after-ms` trailer, if it sent one."""
    for key, value in getattr(e, "trailing_metadata", lambda: None)() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(1, -(-int(value) // 1000))
            except ValueError:
                return None
    return None


def rpc_error_status(e: grpc.RpcError) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, headers) for a failed router call."""
    code = e.code()
    status, type_ = HTTP_OF.get(code, (500, "server_error"))
    headers = {}
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        after = retry_after_s(e)
        if after is not None:
            headers["Retry-After"] = str(after)
    return status, error_body(e.details() or code.name, type_, code=code.name.lower()), headers


def rpc_error_response(e: grpc.RpcError) -> JSONResponse:
    status, body, headers = rpc_error_status(e)
    return JSONResponse(body, status_code=status, headers=headers)
