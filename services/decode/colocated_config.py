"""Colocated instance configuration (CLI flags or PDSERVE_COLOCATED_* environment variables).

A colocated instance is one engine that prefills and decodes (`pdserve serve colocated`): the decode service's
API (Decode.Generate without a prefill target) and the prefill service's prompt cache options.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cache.config import CacheOptions
from pdserve.engine.config import EngineConfig
from pdserve.server.service_config import EngineServiceConfig, engine_settings

HELPS = {
    "chunk_size": "prefill token budget per step: a prefill step (chunks of one or more prompts) computes at most "
    "this many tokens and is always followed by a decode step while sequences run, so a long prompt stalls "
    "decoding by at most one such step",
    "kv_dtype": "int8|fp8|auto: what the KV pool stores (and the prompt cache pages' format)",
}


@dataclass
class ColocatedConfig(CacheOptions, EngineServiceConfig):
    engine: EngineConfig = engine_settings(helps=HELPS, chunk_size=512)

    def validate(self) -> None:
        super().validate()
        self.validate_cache()


ENV_PREFIX = "PDSERVE_COLOCATED_"
