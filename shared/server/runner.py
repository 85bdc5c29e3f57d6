"""Run one gRPC service until SIGTERM/SIGINT: bind, serve health + reflection, announce readiness, drain."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import grpc

from pdserve.server.grpc_util import add_health_and_reflection, announce_ready, bind, make_server, set_serving
from pdserve.server.service_config import EngineOptions, ServerOptions
from pdserve.telemetry.service import Telemetry

log = logging.getLogger("pdserve")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_engine(cfg: EngineOptions, pool_kv_dtype: str):
    """The engine of a prefill or decode instance; `pool_kv_dtype` is what its KV pool stores."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.loop import EngineLoop

    if cfg.torch_threads > 0:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    engine = LLMEngine(cfg.engine_config(pool_kv_dtype))
    return EngineLoop(engine)


def run_service(
    name: str,
    cfg: ServerOptions,
    service_names: list[str],
    register: Callable[[grpc.Server, Telemetry], Callable[[], None]],
) -> None:
    """`register(server, telemetry)` adds the servicer(s) and returns a cleanup callable run after the server stops.
    Telemetry: tracing from the OTEL_* environment, /metrics on `cfg.metrics_port`; spans flushed at shutdown."""
    telemetry = Telemetry(name)
    server = make_server(cfg.max_workers, cfg.max_concurrent_rpcs)
    cleanup = register(server, telemetry)
    hs = add_health_and_reflection(server, service_names)
    port = bind(server, cfg.host, cfg.port)
    metrics_port = telemetry.metrics.serve(cfg.host, cfg.metrics_port)
    server.start()
    set_serving(hs, service_names, True)
    announce_ready(
        name,
        f"{cfg.host}:{port}",
        cfg.ready_file or None,
        metrics=f"{cfg.host}:{metrics_port}" if metrics_port is not None else None,
    )
    announcer = None
    router = getattr(cfg, "router", "")  # only services that register with a router have this field
    if router:  # register with the router and heartbeat (pdserve.server.announce)
        from pdserve.server.announce import Announcer, advertised

        announcer = Announcer(router, name, advertised(cfg.host, port)).start()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("%s draining", name)
    if announcer is not None:
        announcer.stop()  # the router stops sending new work before we stop serving
    set_serving(hs, service_names, False)
    server.stop(grace=5).wait()
    cleanup()
    telemetry.shutdown()  # flushes batched spans
    log.info("%s stopped", name)
