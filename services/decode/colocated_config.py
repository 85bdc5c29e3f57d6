"""Colocated instance configuration (CLI flags or PDSERVE_COLOCATED_* environment variables).

A colocated instance is one engine that prefills and decodes (`pdserve serve colocated`): the decode service's
API (Decode.Generate without a prefill target) and the prefill service's prompt cache options.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cache.config import CacheOptions
from pdserve.server.service_config import EngineOptions, opt


@dataclass
class ColocatedConfig(CacheOptions, EngineOptions):
    chunk_size: int = opt(
        512,
        "prefill token budget per step: a prefill step (chunks of one or more prompts) computes at most this many "
        "tokens and is always followed by a decode step while sequences run, so a long prompt stalls decoding by "
        "at most one such step",
    )
    kv_dtype: str = opt("int8", "int8|fp8|auto: what the KV pool stores (and the prompt cache pages' format)")
    kv_asymmetric: bool = opt(False, "asymmetric int8 (scale + zero point) instead of symmetric")

    def validate(self) -> None:
        super().validate()
        if self.chunk_size < 1:
            raise SystemExit(f"--chunk-size must be >= 1, got {self.chunk_size}")
        self.validate_cache()


ENV_PREFIX = "PDSERVE_COLOCATED_"
