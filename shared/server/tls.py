"""TLS material of a service or client: PEM paths → gRPC server / channel credentials.

One certificate per process serves both directions: it is the server certificate of the ports the process serves
and its client certificate when it dials another service (mTLS between router, prefill and decode). A certificate
used this way needs the SANs its peers dial (host names, IPs) and both serverAuth and clientAuth usage (or no
extended key usage at all). `ca` is the internal CA: callers of an internal port must present a certificate that
chains to it, and the servers a process dials are verified against it (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True when binding `host` exposes the port to this machine only (127.0.0.0/8, ::1, localhost)."""
    h = host.strip("[]")
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a host name or a wildcard ("0.0.0.0", "::", ""): reachable from elsewhere


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"cannot read {what} {path}: {e}") from None
    if b"-----BEGIN " not in data:
        raise SystemExit(f"{what} {path} is not PEM")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """PEM file paths; TLS is on when `cert` is set (with `key`). `ca` alone (no cert) suits a client that only
    verifies the server it dials."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""  # the name peers' certificates are checked against instead of the host dialed

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @property
    def on(self) -> bool:
        return bool(self.cert)

    def problems(self, serving: bool) -> list[str]:
        """What is wrong with this combination (a serving process needs cert and key together)."""
        out = []
        if bool(self.cert) != bool(self.key):
            out.append("--tls-cert and --tls-key go together")
        if serving and self.ca and not self.cert:
            out.append("--tls-ca needs --tls-cert and --tls-key (the service's own certificate)")
        return out

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        """Credentials of a port: with `require_client_auth` (internal ports) a caller must present a certificate
        that chains to `ca`, else the TLS handshake fails."""
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        root = _read(self.ca, "TLS CA") if self.ca else None
        if require_client_auth and root is None:
            raise SystemExit("client-certificate checks need --tls-ca (the internal CA)")
        return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against `ca` (the system roots when unset) and present `cert` when set."""
        root = _read(self.ca, "TLS CA") if self.ca else None
        if self.cert:
            return grpc.ssl_channel_credentials(root, _read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        return grpc.ssl_channel_credentials(root)
