"""Prefill service configuration (CLI flags or PDSERVE_PREFILL_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.service_config import EngineOptions, opt


@dataclass
class PrefillConfig(EngineOptions):
    ack_timeout_s: float = opt(30.0, "how long to wait for decode to acknowledge shipped pages")


ENV_PREFIX = "PDSERVE_PREFILL_"
