"""OpenAI-shaped errors: the router's gRPC status → HTTP status, and the `{"error": {...}}` body (`param`: the
request field at fault, also for the router's INVALID_ARGUMENT reasons, which name the gRPC field)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import grpc
from fastapi.responses import JSONResponse

from pdserve.router.trailers import RETRY_AFTER_KEY

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
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def api_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


# the gRPC API's field names a router reason may start with or mention (the earliest one names the field)
_ROUTER_FIELD = re.compile(
    r"\b(max_tokens|temperature|top_p|top_k|seed|stop_token_ids|stop|top_logprobs|max_reasoning_tokens|prompt"
    r"|token_ids|messages|tool_choice|tools|parallel_tool_calls)\b"
)


def param_aliases(body: dict, chat: bool) -> dict[str, str]:
    """gRPC field → the OpenAI parameter the caller set it with (in this request's body)."""
    prompt = "messages" if chat else "prompt"
    max_tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return {
        "max_tokens": max_tokens,
        "stop_token_ids": "stop",
        "top_logprobs": "top_logprobs" if chat else "logprobs",
        "prompt": prompt,
        "token_ids": prompt,
        "messages": "messages",
    }


def router_param(reason: str, aliases: dict[str, str]) -> str | None:
    """The OpenAI parameter a router INVALID_ARGUMENT `reason` is about, None when it names no field."""
    m = _ROUTER_FIELD.search(reason)
    return None if m is None else aliases.get(m.group(1), m.group(1))


def retry_after_s(e: grpc.RpcError) -> int | None:
    """Whole seconds (rounded up, at least 1) from the router's `retry-after-ms` trailer, if it sent one."""
    for key, value in getattr(e, "trailing_metadata", lambda: None)() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(1, -(-int(value) // 1000))
            except ValueError:
                return None
    return None


def rpc_error_status(e: grpc.RpcError, aliases: dict[str, str] | None = None) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, headers) for a failed router call; `aliases` (`param_aliases`) names the
    request's field in a 400 whose reason mentions one."""
    code = e.code()
    status, type_ = HTTP_OF.get(code, (500, "server_error"))
    headers = {}
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        after = retry_after_s(e)
        if after is not None:
            headers["Retry-After"] = str(after)
    reason = e.details() or code.name
    if code == grpc.StatusCode.NOT_FOUND:  # the router's only NOT_FOUND: a model it does not serve
        return 404, error_body(reason, "invalid_request_error", param="model", code="model_not_found"), headers
    param = router_param(reason, aliases) if code == grpc.StatusCode.INVALID_ARGUMENT and aliases else None
    return status, error_body(reason, type_, param=param, code=code.name.lower()), headers


def rpc_error_response(e: grpc.RpcError, aliases: dict[str, str] | None = None) -> JSONResponse:
    status, body, headers = rpc_error_status(e, aliases)
    return JSONResponse(body, status_code=status, headers=headers)


def http_error_response(
    method: str, path: str, status: int, detail: str, headers: Mapping[str, str] | None
) -> JSONResponse:
    """Starlette's own HTTP errors (an unknown URL, a method a route does not take) in the OpenAI error shape."""
    if status == 404:
        message, code = f"Invalid URL ({method} {path})", "unknown_url"
    elif status == 405:
        message, code = f"Method {method} is not allowed on {path}", "method_not_allowed"
    else:
        message, code = detail, None
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, type_, code=code), status_code=status, headers=headers)
