"""Prefill service configuration (CLI flags or PDSERVE_PREFILL_* environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cache.config import CacheOptions
from pdserve.server.service_config import EngineOptions, opt


@dataclass
class PrefillConfig(CacheOptions, EngineOptions):
    ack_timeout_s: float = opt(
        30.0,
        "longest a shipped KV page may stay unacknowledged by decode; then the "
        "request fails DEADLINE_EXCEEDED and its pages are freed",
    )

    def validate(self) -> None:
        super().validate()
        if not self.ack_timeout_s > 0:
            raise SystemExit(f"--ack-timeout-s must be > 0, got {self.ack_timeout_s}")
        self.validate_cache()


ENV_PREFIX = "PDSERVE_PREFILL_"
