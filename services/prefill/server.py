"""`pdserve serve prefill`: one prefill instance."""
from __future__ import annotations

from pdserve.metrics import watch_engine
from pdserve.prefill.config import PrefillConfig
from pdserve.service_runner import build_engine, run_service
from pdserve.v1 import internal_pb2, internal_pb2_grpc

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def serve(cfg: PrefillConfig) -> None:
    from pdserve.prefill.servicer import PrefillServicer

    loop = build_engine(cfg, pool_kv_dtype="auto")  # prefill keeps full precision; quantizes when shipping

    def register(server, telemetry):
        watch_engine(telemetry.metrics, loop)
        internal_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(cfg, loop, telemetry), server)
        return loop.stop

    run_service("prefill", cfg, [SERVICE], register)
