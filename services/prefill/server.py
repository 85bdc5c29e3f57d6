"""`pdserve serve prefill`: one prefill instance."""

from __future__ import annotations

from pdserve.cache.prompt_cache import build_prompt_cache
from pdserve.prefill.config import PrefillConfig
from pdserve.server.runner import build_engine, run_service
from pdserve.telemetry.metrics import watch_engine, watch_prompt_cache
from pdserve.v1 import internal_pb2

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def serve(cfg: PrefillConfig) -> None:
    from pdserve.prefill.servicer import PrefillServicer, add_prefill_servicer

    # prefill keeps full precision and quantizes when shipping; batch-invariant: it stores the shipped format, so
    # its chunks attend over the same dequantized KV that a prompt-cache hit or the decode instance sees
    loop = build_engine(
        cfg,
        pool_kv_dtype=cfg.kv_dtype if cfg.batch_invariant else "auto",
        ship_formats=[(cfg.kv_dtype, cfg.kv_group_size)],
    )
    cache = build_prompt_cache(cfg)  # Redis (--redis-url / $REDIS_URL), in-process, or None (--prompt-cache false)

    def register(server, telemetry):
        watch_engine(telemetry.metrics, loop)
        if cache is not None:
            watch_prompt_cache(telemetry.metrics, cache)
        servicer = PrefillServicer(cfg, loop, telemetry, cache)
        add_prefill_servicer(servicer, server)  # KV batches go out pre-serialized

        def cleanup() -> None:
            loop.stop()
            servicer.close()
            if cache is not None:
                cache.close()

        return cleanup

    run_service("prefill", cfg, [SERVICE], register)
