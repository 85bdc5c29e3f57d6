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
    kv_transport: str = opt(
        "auto",
        "auto|grpc|cuda-ipc: how KV pages arrive from prefill (offered in each request; auto: cuda-ipc when "
        "prefill is on this host with CUDA, else grpc; a forced transport that cannot work fails the request)",
    )
    first_token_early: bool = opt(
        True,
        "stream the first token to the caller as soon as prefill sampled it, while its KV pages are still on their "
        "way (prefill sends it ahead of the pages); the second token follows once they are all in",
    )
    kv_copy_threads: int = opt(
        4, "threads checking and copying arriving KV batches while the stream's reader takes the next; 0: none"
    )

    def validate(self) -> None:
        super().validate()
        if self.kv_copy_threads < 0:
            raise SystemExit(f"--kv-copy-threads must be >= 0, got {self.kv_copy_threads}")
        if not self.page_timeout_s > 0:
            raise SystemExit(f"--page-timeout-s must be > 0, got {self.page_timeout_s}")
        if self.kv_transport not in ("auto", "grpc", "cuda-ipc"):
            raise SystemExit(f"--kv-transport must be auto, grpc or cuda-ipc, got {self.kv_transport!r}")


ENV_PREFIX = "PDSERVE_DECODE_"
