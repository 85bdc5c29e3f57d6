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
    kv_transport: str = opt(
        "auto",
        "auto|grpc|cuda-ipc: how KV pages reach decode (auto: cuda-ipc when decode is on this host with CUDA, "
        "else grpc; a forced transport that cannot work fails the request)",
    )
    kv_batch_mb: float = opt(8.0, "grpc transport: page bytes per stream message, MiB")
    kv_ipc_staging_mb: float = opt(512.0, "cuda-ipc transport: device staging buffer shared with decode, MiB")

    def default_max_streams(self) -> int:
        """KV streams at once: every decode instance's requests in prefill (several decode instances per prefill)."""
        return 4 * self.max_num_seqs

    prefix_reuse: bool = opt(
        True,
        "keep the prompt pages this instance computed in its KV pool (evictable) and start a request with the "
        "same prefix on them: no compute, no copy; checked before the prompt cache's local tier and store",
    )
    kv_copy_threads: int = opt(
        4, "grpc transport: threads building KV batch messages (checksum, serialization) ahead of the stream; 0: none"
    )

    def validate(self) -> None:
        super().validate()
        if self.kv_copy_threads < 0:
            raise SystemExit(f"--kv-copy-threads must be >= 0, got {self.kv_copy_threads}")
        if not self.ack_timeout_s > 0:
            raise SystemExit(f"--ack-timeout-s must be > 0, got {self.ack_timeout_s}")
        if self.kv_transport not in ("auto", "grpc", "cuda-ipc"):
            raise SystemExit(f"--kv-transport must be auto, grpc or cuda-ipc, got {self.kv_transport!r}")
        if not (self.kv_batch_mb > 0 and self.kv_ipc_staging_mb > 0):
            raise SystemExit("--kv-batch-mb and --kv-ipc-staging-mb must be > 0")
        self.validate_cache()


ENV_PREFIX = "PDSERVE_PREFILL_"
