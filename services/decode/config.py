"""Decode service configuration (CLI flags or PDSERVE_DECODE_* environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server.service_config import EngineOptions, opt


@dataclass
class DecodeConfig(EngineOptions):
    kv_asymmetric: bool = opt(False, "asymmetric int8 (scale + zero point) instead of symmetric")
    page_timeout_s: float = opt(
        30.0,
        "longest wait for the next message (KV page or done) from prefill; then "
        "the request fails DEADLINE_EXCEEDED and its pages are freed",
    )

    def validate(self) -> None:
        super().validate()
        if not self.page_timeout_s > 0:
            raise SystemExit(f"--page-timeout-s must be > 0, got {self.page_timeout_s}")


ENV_PREFIX = "PDSERVE_DECODE_"
