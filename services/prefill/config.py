"""Prefill service configuration (CLI flags or PDSERVE_PREFILL_* environment variables).

`--kv-dtype` on prefill: the page format decode's layout is expected to ask for. Decode's layout decides what is
shipped (each request carries it; prefill computes in full precision and quantizes when shipping), so one prefill
can serve decode instances of several formats. The flag decides what prefill prepares: the warm-up's export and
import format and, with `--batch-invariant`, what its own pool stores. A request whose layout differs is served
and logged once per format (`pdserve.prefill.kv_format.ShipFormatCheck`).

`--tensor-parallel-size N`: this process is rank 0 (gRPC server, scheduler) and starts ranks 1..N-1; each rank
computes and quantizes its own KV heads, rank 0 assembles pages of every head (`pdserve.engine.tp.page_export`) and
ships them as a TP=1 prefill would, so a decode instance at any TP size takes them (each of its ranks keeps its own
heads) and the prompt cache's pages do not depend on N. Pages ship by whole chunks (`--kv-layer-group` is off: a
layer group would leave mid-forward while the other ranks compute).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.cache.config import CacheOptions
from pdserve.engine.config import EngineConfig
from pdserve.server.service_config import EngineServiceConfig, engine_settings, kv_link_problems, opt

KV_DTYPE_HELP = (
    "int8|fp8|auto: the KV page format decode is expected to ask for (decode's layout decides what is shipped; "
    "another format is served and logged once): the warm-up's format and, with --batch-invariant, the pool's"
)


@dataclass
class PrefillConfig(CacheOptions, EngineServiceConfig):
    engine: EngineConfig = engine_settings(helps={"kv_dtype": KV_DTYPE_HELP})
    ack_timeout_s: float = opt(
        30.0,
        "longest a shipped KV page may stay unacknowledged by decode; then the "
        "request fails DEADLINE_EXCEEDED and its pages are freed",
    )
    kv_transport: str = opt(
        "auto",
        "auto|grpc|cuda-ipc|grpc-shm: how KV pages reach decode (auto: cuda-ipc when decode is on this host with "
        "CUDA, else grpc-shm when both ends run a KV shipper, else grpc; grpc-shm: gRPC between shipper processes "
        "beside both engines; a forced transport that cannot work fails the request)",
    )
    kv_shipper: str = opt(
        "auto",
        "auto|on|off: run a KV shipper process beside the engine, which moves grpc-shm batches' bytes (gRPC's "
        "copies then hold its GIL, not the engine process's); auto: on with CUDA; --kv-transport grpc-shm turns it on. "
        "Measured faster than in-process grpc on a GPU host (docs/kv_transfer.md)",
    )
    kv_shippers: int = opt(
        2,
        "grpc-shm: KV shipper processes beside the engine (1..16); batches are spread over them, since one shipper "
        "pair is bound by Python gRPC's copies under one process's GIL; they share --kv-shipper-arena-mb",
    )
    kv_shipper_arena_mb: float = opt(
        512.0,
        "grpc-shm: shared host memory (pinned on CUDA) where batches wait for the shippers and decode, MiB, all "
        "shippers together (each gets its --kv-shippers share)",
    )
    kv_batch_mb: float = opt(8.0, "grpc transport: page bytes per stream message, MiB")
    kv_ipc_staging_mb: float = opt(512.0, "cuda-ipc transport: device staging buffer shared with decode, MiB")
    prefix_reuse: bool = opt(
        True,
        "keep the prompt pages this instance computed in its KV pool (evictable) and start a request with the "
        "same prefix on them: no compute, no copy; checked before the prompt cache's local tier and store",
    )
    kv_copy_threads: int = opt(
        4, "grpc transport: threads building KV batch messages (checksum, serialization) ahead of the stream; 0: none"
    )
    kv_layer_group: int = opt(
        4,
        "layers per KV shipment: a computed chunk's pages leave in groups of this many layers as the forward "
        "writes them, so even a one-chunk prompt's transfer overlaps its compute (smaller: more overlap, more "
        "messages); 0 or >= the model's layers: whole chunks after the forward. Only to a decode that accepts them",
    )
    head_start: bool = opt(
        True,
        "take the router's head starts (Prefill.Start): a request's prefill begins beside the router's dispatch to "
        "decode, and decode's stream takes the computed request over (one hop less before the first chunk)",
    )
    head_start_wait_s: float = opt(
        2.0, "a head start no decode stream takes within this many seconds is dropped (its pages freed)"
    )
    head_start_limit: int = opt(64, "head starts waiting for their decode streams at once; more are not started")

    def default_max_streams(self) -> int:
        """KV streams at once: every decode instance's requests in prefill (several decode instances per prefill)."""
        return 4 * self.engine.max_num_seqs

    def pool_config(self) -> EngineConfig:
        """The engine prefill runs: it keeps full precision and quantizes when shipping; batch-invariant, its pool
        stores the shipped format, so its chunks attend over the same dequantized KV that a prompt-cache hit or the
        decode instance sees."""
        return self.engine if self.engine.batch_invariant else replace(self.engine, kv_dtype="auto")

    def ship_formats(self) -> list[tuple[str, int]]:
        """(kv dtype, group size) of the pages the warm-up exports and imports: the format of `--kv-dtype`."""
        return [(self.engine.kv_dtype, self.engine.kv_group_size)]

    def validate(self) -> None:
        super().validate()
        problems = kv_link_problems(
            self.kv_transport, self.kv_copy_threads, self.kv_shipper, self.kv_shipper_arena_mb, self.kv_shippers
        )
        if self.kv_shippers > 0 and 2 * self.kv_batch_mb > self.kv_shipper_arena_mb / self.kv_shippers:
            problems.append(
                f"each KV shipper's arena (--kv-shipper-arena-mb / --kv-shippers = {self.kv_shipper_arena_mb:g} / "
                f"{self.kv_shippers}) must hold two batches of --kv-batch-mb ({self.kv_batch_mb:g})"
            )
        if not self.ack_timeout_s > 0:
            problems.append(f"--ack-timeout-s must be > 0, got {self.ack_timeout_s}")
        if not (self.kv_batch_mb > 0 and self.kv_ipc_staging_mb > 0):
            problems.append("--kv-batch-mb and --kv-ipc-staging-mb must be > 0")
        if not (self.head_start_wait_s > 0 and self.head_start_limit > 0):
            problems.append("--head-start-wait-s and --head-start-limit must be > 0")
        if self.kv_layer_group < 0:
            problems.append(f"--kv-layer-group must be >= 0, got {self.kv_layer_group}")
        if problems:
            raise SystemExit("; ".join(problems))
        self.validate_cache()


ENV_PREFIX = "PDSERVE_PREFILL_"
