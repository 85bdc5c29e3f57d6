"""Prefill service configuration (CLI flags or PDSERVE_PREFILL_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.cache.config import CacheOptions
from pdserve.server.service_config import EngineOptions, opt


@dataclass
class PrefillConfig(CacheOptions, EngineOptions):
    ack_timeout_s: float = opt(30.0, "how long to wait for decode to acknowledge shipped pages")

    def validate(self) -> None:
        super().validate()
        self.validate_cache()


ENV_PREFIX = "PDSERVE_PREFILL_"
