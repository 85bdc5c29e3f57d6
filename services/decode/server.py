"""`pdserve serve decode`: one decode instance."""

from __future__ import annotations

from pdserve.decode.config import DecodeConfig
from pdserve.server.runner import build_engine, run_service
from pdserve.telemetry.metrics import watch_engine
from pdserve.v1 import internal_pb2, internal_pb2_grpc

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def serve(cfg: DecodeConfig) -> None:
    from pdserve.decode.servicer import DecodeServicer

    loop = build_engine(cfg)  # its pool stores what prefill ships to it (--kv-dtype)
    if cfg.gpu_share_file and cfg.yield_tpot_ms > 0:  # hold steps back while the prefill on this GPU computes
        from pdserve.engine.gpu_share import DecodeYield, GpuShareFlag, TpotRoom

        room = TpotRoom(cfg.yield_tpot_ms)
        loop.share_yield = DecodeYield(GpuShareFlag(cfg.gpu_share_file), room, cfg.yield_cap_ms)

    def register(server, telemetry):
        watch_engine(telemetry.metrics, loop)
        servicer = DecodeServicer(cfg, loop, telemetry)
        internal_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

        def cleanup():
            servicer.close()  # channels to prefill instances, KV copy threads
            loop.stop()

        return cleanup

    run_service("decode", cfg, [SERVICE], register)
