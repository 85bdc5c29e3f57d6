"""A service's security settings resolved once (flags > per-service env > the stack-wide env below), the startup
rules that refuse an unsafe configuration, and the internal identity its outgoing channels carry.

Stack-wide environment (what `pdserve up`, compose and k8s hand every process; the health command reads it too):
  PDSERVE_INTERNAL_TOKEN / PDSERVE_INTERNAL_TOKEN_FILE   the internal token (value / file)
  PDSERVE_TLS_CERT, PDSERVE_TLS_KEY, PDSERVE_TLS_CA      PEM paths (pdserve.server.tls)
  PDSERVE_TLS_SERVER_NAME                                the SAN peers are verified against (pods dialed by IP)
"""

from __future__ import annotations

import logging
import os
from collections import namedtuple
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.server.auth import INTERNAL_TOKEN_KEY, InternalAuth, check_token, read_token_file
from pdserve.server.tls import TlsConfig, is_loopback

log = logging.getLogger("pdserve.server.security")

ENV_TOKEN, ENV_TOKEN_FILE = "PDSERVE_INTERNAL_TOKEN", "PDSERVE_INTERNAL_TOKEN_FILE"
ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA = "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"
ENV_TLS_SERVER_NAME = "PDSERVE_TLS_SERVER_NAME"


def token_from(path: str, environ: Mapping[str, str]) -> str | None:
    """The internal token: `path`, else $PDSERVE_INTERNAL_TOKEN_FILE, else $PDSERVE_INTERNAL_TOKEN, else None."""
    path = path or environ.get(ENV_TOKEN_FILE, "")
    if path:
        return read_token_file(path)
    value = environ.get(ENV_TOKEN, "")
    return check_token(value, f"${ENV_TOKEN}") if value else None


def tls_from(cert: str, key: str, ca: str, environ: Mapping[str, str], server_name: str = "") -> TlsConfig:
    return TlsConfig(
        cert or environ.get(ENV_TLS_CERT, ""),
        key or environ.get(ENV_TLS_KEY, ""),
        ca or environ.get(ENV_TLS_CA, ""),
        server_name or environ.get(ENV_TLS_SERVER_NAME, ""),
    )


class _CallDetails(
    namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _AddMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (the internal token) to every call of a channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]):
        self._md = list(metadata)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        md = [*(d.metadata or ()), *self._md]
        return _CallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


@dataclass(frozen=True)
class ChannelSecurity:
    """What an internal channel carries: TLS (verifying the peer against `tls.ca`, presenting `tls.cert` for mTLS)
    when `tls` names a CA or a certificate, and the internal token as metadata when set."""

    tls: TlsConfig = field(default_factory=TlsConfig)
    token: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChannelSecurity:
        """The stack-wide identity of this process's environment (see the module docstring)."""
        env = os.environ if environ is None else environ
        return cls(tls_from("", "", "", env), token_from("", env))

    @classmethod
    def anonymous(cls) -> ChannelSecurity:
        return cls()

    def open(self, target: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        if self.tls.ca or self.tls.cert:
            opts = [*options, *self.tls.channel_options()]
            ch = grpc.secure_channel(target, self.tls.channel_credentials(), options=opts)
        else:
            ch = grpc.insecure_channel(target, options=list(options))
        if self.token:
            ch = grpc.intercept_channel(ch, _AddMetadata([(INTERNAL_TOKEN_KEY, self.token)]))
        return ch


@dataclass(frozen=True)
class ServiceSecurity:
    """The security settings of one service process (pdserve.server.service_config.ServerOptions' fields)."""

    tls: TlsConfig
    token: str | None
    insecure: bool

    @classmethod
    def of(cls, cfg, environ: Mapping[str, str] | None = None) -> ServiceSecurity:
        env = os.environ if environ is None else environ
        tls = tls_from(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, env, cfg.tls_server_name)
        problems = tls.problems(serving=True)
        if problems:
            raise SystemExit("; ".join(problems))
        return cls(tls, token_from(cfg.internal_token_file, env), bool(cfg.insecure))

    @property
    def client_certs(self) -> bool:
        """Internal ports check client certificates (mTLS): TLS on with an internal CA."""
        return self.tls.on and bool(self.tls.ca)

    def refusal(self, name: str, host: str, internal: bool) -> str | None:
        """Why serving this port would be unsafe (None: it may start)."""
        where = f"{name} on {host or '*'}"
        if self.insecure:
            return None
        if not self.tls.on and not is_loopback(host):
            return (
                f"{where}: refusing to serve plaintext on a non-loopback address; give --tls-cert/--tls-key "
                "(docs/security.md) or --insecure"
            )
        if internal and self.token is None and not self.client_certs:
            return (
                f"{where}: an internal port needs an internal identity: --internal-token-file (or ${ENV_TOKEN}), or "
                "--tls-ca with --tls-cert/--tls-key (client certificates); or --insecure"
            )
        return None

    def check_port(self, name: str, host: str, internal: bool) -> None:
        """Refuse to serve what would be open to anyone (SystemExit), or say what is weak (log)."""
        why = self.refusal(name, host, internal)
        if why:
            raise SystemExit(why)
        where = f"{name} on {host or '*'}"
        if not self.tls.on:
            if is_loopback(host):
                log.warning("%s: plaintext (no TLS), loopback only", where)
            else:
                log.warning("%s: PLAINTEXT on a non-loopback address (--insecure): traffic and tokens in clear", where)
        if internal and self.token is None and not self.client_certs:
            log.warning("%s: internal RPCs accept ANY caller (--insecure, no token, no client certificates)", where)

    def server_credentials(self, internal: bool) -> grpc.ServerCredentials | None:
        """None: plaintext. Internal ports require a client certificate from the CA when there is one."""
        if not self.tls.on:
            return None
        return self.tls.server_credentials(require_client_auth=internal and self.client_certs)

    def internal_auth(self) -> InternalAuth:
        return InternalAuth(self.token)

    def channel(self) -> ChannelSecurity:
        """The identity this service's own internal calls carry."""
        return ChannelSecurity(self.tls, self.token)
