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

    loop = build_engine(cfg, cfg.pool_config(), ship_formats=cfg.ship_formats())
    if cfg.gpu_share_file:  # its steps marked for the decode engine on this GPU (pdserve.engine.gpu_share)
        from pdserve.engine.gpu_share import GpuShareFlag

        loop.share_mark = GpuShareFlag(cfg.gpu_share_file)
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
