"""Decode service configuration (CLI flags or PDSERVE_DECODE_* environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.server.service_config import EngineServiceConfig, engine_settings, kv_link_problems, opt

KV_DTYPE_HELP = (
    "int8|fp8|auto: what the KV pool stores, and so the page format prefill ships to this instance (every request "
    "names it); fp8: e4m3, one scale per token and KV head; auto: the model dtype, unquantized"
)


@dataclass
class DecodeConfig(EngineServiceConfig):
    engine: EngineConfig = engine_settings(helps={"kv_dtype": KV_DTYPE_HELP})
    page_timeout_s: float = opt(
        30.0,
        "shortest bound on the wait for the next message (KV page or done) from prefill; past the bound the "
        "request fails DEADLINE_EXCEEDED and its pages are freed. The bound scales with the work ahead: the prompt "
        "tokens this instance still awaits from that prefill (the request's batch mates included) at the rate they "
        "arrived, times --page-timeout-slack, up to --page-timeout-max-s",
    )
    yield_tpot_ms: float = opt(
        0.0,
        "with --gpu-share-file: while the prefill on this GPU computes, hold decode steps back as long as every "
        "running request's TPOT stays within this many ms (should its next token be its last); 0 = never wait "
        "(`pdserve up` sets 13/15 of the router's --slo-tpot-ms on a GPU it shares)",
    )
    yield_cap_ms: float = opt(
        60.0, "the most --yield-tpot-ms holds one decode step back in all: what it may add to one inter-token latency"
    )
    page_timeout_max_s: float = opt(300.0, "longest bound on the wait for the next KV page, however much work is ahead")
    page_timeout_slack: float = opt(
        3.0, "the page wait's margin over the expected time of the work ahead (a later chunk attends to more tokens)"
    )
    kv_transport: str = opt(
        "auto",
        "auto|grpc|cuda-ipc|grpc-shm: how KV pages arrive from prefill (offered in each request; auto: cuda-ipc "
        "when prefill is on this host with CUDA, else grpc-shm when both ends run a KV shipper, else grpc; a forced "
        "transport that cannot work fails the request)",
    )
    kv_shipper: str = opt(
        "auto",
        "auto|on|off: run a KV shipper process beside the engine, which receives grpc-shm batches' bytes (gRPC's "
        "copies then hold its GIL, not the engine process's); auto: on with CUDA; --kv-transport grpc-shm turns it on. "
        "Measured faster than in-process grpc on a GPU host (docs/kv_transfer.md)",
    )
    kv_shippers: int = opt(
        2,
        "grpc-shm: KV shipper processes beside the engine (1..16); batches are spread over them, since one shipper "
        "pair is bound by Python gRPC's copies under one process's GIL; they share --kv-shipper-arena-mb",
    )
    kv_shipper_arena_mb: float = opt(
        1024.0,
        "grpc-shm: shared host memory (pinned on CUDA) where arriving batches land, MiB, all shippers together "
        "(each gets its --kv-shippers share)",
    )
    kv_shipper_port: int = opt(
        0,
        "grpc-shm: the shippers' first port on --host, where prefills' shippers push (internal): P > 0 gives the "
        "--kv-shippers shippers P, P+1, ..., P+N-1; 0 = each picks a free port",
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
        problems = kv_link_problems(
            self.kv_transport, self.kv_copy_threads, self.kv_shipper, self.kv_shipper_arena_mb, self.kv_shippers
        )
        if self.kv_shipper_port and not 0 < self.kv_shipper_port <= 65536 - max(self.kv_shippers, 1):
            problems.append(
                f"--kv-shipper-port {self.kv_shipper_port} with --kv-shippers {self.kv_shippers}: the ports "
                f"P..P+N-1 must lie in 1..65535"
            )
        if not self.page_timeout_s > 0:
            problems.append(f"--page-timeout-s must be > 0, got {self.page_timeout_s}")
        if not self.page_timeout_max_s >= self.page_timeout_s:
            problems.append(f"--page-timeout-max-s must be >= --page-timeout-s, got {self.page_timeout_max_s}")
        if not self.page_timeout_slack >= 1:
            problems.append(f"--page-timeout-slack must be >= 1, got {self.page_timeout_slack}")
        if not (0 <= self.yield_tpot_ms <= 1000 and 0 <= self.yield_cap_ms <= 10_000):
            problems.append(
                f"--yield-tpot-ms must be in [0, 1000] and --yield-cap-ms in [0, 10000], got {self.yield_tpot_ms:g} "
                f"and {self.yield_cap_ms:g}"
            )
        if problems:
            raise SystemExit("; ".join(problems))


ENV_PREFIX = "PDSERVE_DECODE_"
