"""Gateway configuration: PDSERVE_GATEWAY_* environment variables and CLI flags (flag > environment > default)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server.service_config import opt

ENV_PREFIX = "PDSERVE_GATEWAY_"


@dataclass
class GatewayConfig:
    router: str = opt("", "router host:port (the gRPC Generation service)")
    host: str = opt("127.0.0.1", "interface to bind")
    port: int = opt(0, "HTTP port to bind (0 = any free port)")
    model_name: str = opt("pdserve", "the model id /v1/models lists and requests must name")
    request_timeout_s: float = opt(600.0, "deadline of each call to the router")
    max_body_mb: float = opt(8.0, "largest request body accepted, MiB (larger: 413 at once, before parsing)")
    ready_file: str = opt("", "write {service, address, pid} JSON here once serving")
    log_level: str = opt("INFO", "logging level")

    def validate(self) -> None:
        if not self.router:
            raise SystemExit("--router HOST:PORT is required")
        if not self.model_name:
            raise SystemExit("--model-name must not be empty")
        if self.max_body_mb <= 0:
            raise SystemExit(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.request_timeout_s <= 0:
            raise SystemExit(f"--request-timeout-s must be > 0, got {self.request_timeout_s}")
