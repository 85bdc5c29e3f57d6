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
    "chunk_size": "prefill tokens per step: every step decodes the running batch and prefills chunks of one or more "
    "prompts beside it, at most this many prompt tokens (and --step-token-budget in all); with the auto budget "
    "on a GPU the measured size replaces it",
    "step_token_budget": "tokens one step computes, decode rows + prefill tokens (0: --chunk-size): it bounds the "
    "step's time, so TPOT while prompts are prefilled; prefill gets what the decode rows leave (at least a quarter). "
    "-1 (auto): on a GPU, after the warm-up, the smallest measured prefill size per step whose fixed cost (weight "
    "read, launches) is <= 10% of the step (pdserve.decode.step_budget), decode rows on top; on CPU --chunk-size",
    "kv_dtype": "int8|fp8|auto: what the KV pool stores (and the prompt cache pages' format)",
}


@dataclass
class ColocatedConfig(CacheOptions, EngineServiceConfig):
    engine: EngineConfig = engine_settings(helps=HELPS, chunk_size=512, step_token_budget=-1)

    def validate(self) -> None:
        super().validate()
        self.validate_cache()


ENV_PREFIX = "PDSERVE_COLOCATED_"
