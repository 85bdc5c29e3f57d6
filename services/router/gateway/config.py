"""Gateway configuration: PDSERVE_GATEWAY_* environment variables and CLI flags (flag > environment > default)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.config import opt
from pdserve.server.tls import is_loopback

ENV_PREFIX = "PDSERVE_GATEWAY_"


@dataclass
class GatewayConfig:
    router: str = opt("", "router host:port (the gRPC Generation service)")
    host: str = opt("127.0.0.1", "interface to bind")
    port: int = opt(0, "HTTP port to bind (0 = any free port)")
    model_name: str = opt(
        "pdserve",
        "the model id /v1/models lists and requests name while the router serves one model (an alias of its "
        "name); a router serving several: their own names (Generation.ListModels)",
    )
    request_timeout_s: float = opt(600.0, "deadline of each call to the router")
    pushback_wait_s: float = opt(
        20.0,
        "while the router answers 'at capacity' (RESOURCE_EXHAUSTED with a pushback), retry it after each pushback "
        "for up to this long in all before answering 429 with Retry-After; 0 = answer 429 at once",
    )
    models_cache_s: float = opt(
        2.0, "reuse the router's model list (ListModels) this long per caller credential; 0 = ask on every request"
    )
    models_cache_size: int = opt(1024, "caller credentials whose model list is kept (the least recently used goes)")
    max_body_mb: float = opt(8.0, "largest request body accepted, MiB (larger: 413 at once, before parsing)")
    # slow or too many clients (docs/security.md, "Gateway limits")
    header_timeout_s: float = opt(
        10.0, "a request's line and headers must arrive within this time (from the connection or its first byte): 408"
    )
    body_timeout_s: float = opt(30.0, "a request body must arrive within this time of its headers: else 408")
    keep_alive_s: float = opt(5.0, "an idle kept-alive connection is closed after this time")
    max_connections: int = opt(1024, "connections served at once; a request on one more is answered 503")
    max_header_kb: int = opt(16, "request line + headers still incomplete after this many KiB: 400")
    ready_file: str = opt("", "write {service, address, pid} JSON here once serving")
    log_level: str = opt("INFO", "logging level")
    # security (docs/security.md): callers' `Authorization: Bearer` goes on to the router, which authenticates it
    tls_cert: str = opt("", "PEM certificate: serve HTTPS (needed on a non-loopback --host unless --insecure)")
    tls_key: str = opt("", "PEM key of --tls-cert")
    tls_ca: str = opt("", "PEM CA of the router's certificate: TLS to the router ($PDSERVE_TLS_CA)")
    router_tls: bool = opt(False, "TLS to the router verified against the system roots (without --tls-ca)")
    insecure: bool = opt(False, "allow plain HTTP on a non-loopback --host")

    def validate(self) -> None:
        if not self.router:
            raise SystemExit("--router HOST:PORT is required")
        if not self.model_name:
            raise SystemExit("--model-name must not be empty")
        if self.max_body_mb <= 0:
            raise SystemExit(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.request_timeout_s <= 0:
            raise SystemExit(f"--request-timeout-s must be > 0, got {self.request_timeout_s}")
        if self.models_cache_s < 0:
            raise SystemExit(f"--models-cache-s must be >= 0, got {self.models_cache_s}")
        if self.pushback_wait_s < 0:
            raise SystemExit(f"--pushback-wait-s must be >= 0, got {self.pushback_wait_s}")
        names = ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_connections", "max_header_kb")
        for name in (*names, "models_cache_size"):
            if not getattr(self, name) > 0:
                raise SystemExit(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        if not self.tls_cert and not self.insecure and not is_loopback(self.host):
            raise SystemExit(
                f"gateway on {self.host}: refusing plain HTTP on a non-loopback address; give --tls-cert/--tls-key "
                "or --insecure"
            )

    def router_tls_ca(self) -> str:
        return self.tls_ca or os.environ.get("PDSERVE_TLS_CA", "")
