"""Who may call what (docs/security.md).

- Internal identity (Prefill, Decode, the router's Registry port): a shared internal token sent as metadata
  `x-pdserve-internal-token` (`InternalAuth`), and/or, with TLS, a client certificate from the internal CA
  (checked by the TLS handshake itself, `pdserve.server.tls`).
- Public callers (the router's Generation service): bearer tokens (`authorization: Bearer <token>`), each mapped
  to a tenant (`Authenticator`); without a token list every caller is tenant "default".

A missing credential fails UNAUTHENTICATED, a wrong one PERMISSION_DENIED, before the servicer runs and before the
request is parsed. grpc.health.v1 and server reflection stay open on every port.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import grpc

log = logging.getLogger("pdserve.server.auth")

INTERNAL_TOKEN_KEY = "x-pdserve-internal-token"
AUTHORIZATION_KEY = "authorization"
DEFAULT_TENANT = "default"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")
PUBLIC_SERVICES = ("/pdserve.v1.Generation/",)
_TOKEN = re.compile(r"[\x21-\x7e]{16,4096}")  # printable ASCII without spaces: valid gRPC metadata, no stray newline
_TENANT = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


def new_token() -> str:
    """A random internal token (what `pdserve up` hands its stack)."""
    return secrets.token_urlsafe(32)


def check_token(token: str, what: str) -> str:
    if not _TOKEN.fullmatch(token):
        raise SystemExit(f"{what}: a token is 16-4096 printable ASCII characters without spaces")
    return token


def read_token_file(path: str) -> str:
    try:
        return check_token(Path(path).read_text().strip(), f"token file {path}")
    except OSError as e:
        raise SystemExit(f"cannot read token file {path}: {e}") from None


def _metadata(details_or_context) -> Mapping[str, str | bytes]:
    md = (
        details_or_context.invocation_metadata
        if isinstance(details_or_context, grpc.HandlerCallDetails)
        else details_or_context.invocation_metadata()
    )
    return dict(md or ())


def deny_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that fails the RPC with (code, details) without reading the request."""

    def abort(_request, context: grpc.ServicerContext):
        context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class InternalAuth(grpc.ServerInterceptor):
    """Every RPC but health and reflection must carry the internal token (when one is configured)."""

    def __init__(self, token: str | None):
        self._token = token.encode() if token else None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if self._token is None or handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        got = _metadata(handler_call_details).get(INTERNAL_TOKEN_KEY)
        if got is None:
            missing = f"internal RPC without the internal token ({INTERNAL_TOKEN_KEY})"
            return deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED, missing)
        if not hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token):
            return deny_handler(handler, grpc.StatusCode.PERMISSION_DENIED, "wrong internal token")
        return handler


def parse_tokens(text: str, where: str) -> dict[str, str]:
    """Bearer token → tenant from a JSON object {"token": "tenant"} or lines `token tenant` (`#` comments; in an
    environment variable entries may also be separated by commas)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            pairs = list(json.loads(text).items())
        except (json.JSONDecodeError, AttributeError) as e:
            raise SystemExit(f"{where}: not a JSON object of token → tenant: {e}") from None
    else:
        pairs = []
        for n, line in enumerate(re.split(r"[\n,]", text), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise SystemExit(f"{where}: entry {n} must be `token tenant`")
            pairs.append((parts[0], parts[1]))
    tokens: dict[str, str] = {}
    for token, tenant in pairs:
        if not isinstance(token, str) or not isinstance(tenant, str):
            raise SystemExit(f"{where}: tokens and tenants are strings")
        check_token(token, where)
        if not _TENANT.fullmatch(tenant):
            raise SystemExit(f"{where}: tenant {tenant!r} must be 1-128 of A-Z a-z 0-9 _ . : @ -")
        if token in tokens:
            raise SystemExit(f"{where}: a token is listed twice")
        tokens[token] = tenant
    if not tokens:
        raise SystemExit(f"{where}: no tokens")
    return tokens


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class Authenticator(grpc.ServerInterceptor):
    """Bearer tokens of the public API. `tokens` None: auth off, every caller is tenant "default". As an
    interceptor it refuses public RPCs without a known token before they are parsed; `tenant_of(context)` is the
    caller's tenant (the router servicer's `tenant_of`)."""

    def __init__(self, tokens: Mapping[str, str] | None):
        # looked up by digest: the time a lookup takes says nothing about how much of a guess matched
        self._tenants = None if tokens is None else {_digest(t): tenant for t, tenant in tokens.items()}

    @classmethod
    def from_config(cls, path: str, environ: Mapping[str, str]) -> Authenticator:
        """From `--auth-tokens-file PATH`, else $PDSERVE_AUTH_TOKENS, else auth off."""
        if path:
            try:
                return cls(parse_tokens(Path(path).read_text(), f"auth tokens file {path}"))
            except OSError as e:
                raise SystemExit(f"cannot read auth tokens file {path}: {e}") from None
        if environ.get("PDSERVE_AUTH_TOKENS"):
            return cls(parse_tokens(environ["PDSERVE_AUTH_TOKENS"], "$PDSERVE_AUTH_TOKENS"))
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self._tenants is not None

    @property
    def tenants(self) -> set[str]:
        return set((self._tenants or {}).values())

    def _lookup(self, md: Mapping[str, str | bytes]) -> tuple[grpc.StatusCode, str] | str:
        """The tenant, or the status refusing the call."""
        if self._tenants is None:
            return DEFAULT_TENANT
        value = md.get(AUTHORIZATION_KEY)
        if value is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (authorization: Bearer <token>)"
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return grpc.StatusCode.UNAUTHENTICATED, "authorization must be `Bearer <token>`"
        tenant = self._tenants.get(_digest(token.strip()))
        if tenant is None:
            return grpc.StatusCode.PERMISSION_DENIED, "unknown bearer token"
        return tenant

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PUBLIC_SERVICES):
            return handler
        found = self._lookup(_metadata(handler_call_details))
        if isinstance(found, tuple):
            return deny_handler(handler, *found)
        return handler

    def tenant_of(self, context: grpc.ServicerContext) -> str:
        found = self._lookup(_metadata(context))
        if isinstance(found, tuple):
            context.abort(*found)
        assert isinstance(found, str)
        return found


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    return [(AUTHORIZATION_KEY, f"Bearer {token}")] if token else []
