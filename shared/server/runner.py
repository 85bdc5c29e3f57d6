"""Run one gRPC service until SIGTERM/SIGINT: security checks, bind, serve health + reflection, announce readiness,
drain."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.server.auth import Authenticator
from pdserve.server.gc_pauses import GcPauses, freeze_startup_heap
from pdserve.server.gil import set_switch_interval
from pdserve.server.grpc_util import add_health_and_reflection, announce_ready, bind, make_server, set_serving
from pdserve.server.host_memory import release_free_heap, tune_malloc
from pdserve.server.security import ServiceSecurity
from pdserve.server.service_config import EngineServiceConfig, ServerOptions
from pdserve.server.shutdown import Shutdown
from pdserve.server.stream_gate import StreamGate
from pdserve.telemetry.service import Telemetry

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig

log = logging.getLogger("pdserve")
MIB = 1 << 20


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_engine(
    cfg: EngineServiceConfig, engine_cfg: EngineConfig | None = None, ship_formats: Sequence[tuple[str, int]] = ()
):
    """The engine loop of a prefill, decode or colocated instance, warmed up (`--warmup`: fully on a GPU, one tiny
    request on CPU, `pdserve.engine.warmup`). The engine is
    `engine_cfg` (default: `cfg.engine` as it is); `ship_formats` the (kv dtype, group size) of pages it exports
    and imports from a prompt cache."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.loop import EngineLoop
    from pdserve.engine.warmup import warm_up

    interval = set_switch_interval(cfg.gil_switch_interval_us)  # process-wide: every thread, the engine's included
    log.info("GIL switch interval: %g us", interval)
    tune_malloc()  # KV batches are multi-MB host buffers: reuse faulted-in memory (pdserve.server.host_memory)
    if cfg.torch_threads > 0:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    engine = LLMEngine(cfg.engine if engine_cfg is None else engine_cfg)
    if cfg.warmup:  # full on a GPU (compiles, graphs); on CPU one tiny request (nothing to compile)
        warm_up(engine, ship_formats, light=engine.runner.device.type != "cuda")
    else:
        log.info("engine warm-up: off (--no-warmup)")
    release_free_heap()  # the load's freed copies (checkpoint tensors before q/k/v, gate/up concatenation)
    return EngineLoop(engine)


DRAIN_END_MARGIN_S = 2.0  # after the drain grace: time for ended streams to send their status before the cut


def run_service(
    name: str,
    cfg: ServerOptions,
    service_names: list[str],
    register: Callable[..., Callable[[], None]],
    *,
    public: Authenticator | None = None,
    internal_services: Sequence[str] = (),
) -> None:
    """Serve until SIGTERM/SIGINT, then drain. `register(server, telemetry)` adds the servicer(s) and returns a
    cleanup callable run after the server stopped. Telemetry: tracing from the OTEL_* environment, /metrics on
    `cfg.metrics_port`; spans flushed at shutdown.

    Ports (docs/security.md): the main port (`cfg.port`) is internal (internal identity required: token and/or
    client certificate) unless `public` is given, the authenticator of a public port. With `internal_services` a
    second, internal port (`cfg.internal_port`) serves those and `register` is called with `internal=` its server.
    Thread budget: long RPCs pass a `StreamGate` of `cfg.stream_limit()`; the pool has that many threads plus
    `cfg.control_threads`. Drain: deregister, NOT_SERVING, refuse new calls, let streams run up to
    `cfg.drain_grace_s`, end the rest with UNAVAILABLE."""
    shutdown = Shutdown.install(name)
    security = ServiceSecurity.of(cfg)
    security.check_port(name, cfg.host, internal=public is None)
    telemetry = Telemetry(name)
    gate = StreamGate(name, cfg.stream_limit())
    workers = gate.limit + cfg.control_threads
    server = make_server(
        workers,
        2 * workers,
        [public if public is not None else security.internal_auth(), gate],
        int(cfg.max_receive_mb * MIB),
    )
    internal_server = None
    if internal_services:
        internal_server = make_server(
            cfg.control_threads,
            4 * cfg.control_threads,
            [security.internal_auth()],
            int(getattr(cfg, "internal_max_receive_mb", cfg.max_receive_mb) * MIB),
        )
        cleanup = register(server, telemetry, internal=internal_server)
    else:
        cleanup = register(server, telemetry)
    hs = add_health_and_reflection(server, service_names)
    port = bind(server, cfg.host, cfg.port, security.server_credentials(internal=public is None))
    internal_address = None
    internal_hs = None
    if internal_server is not None:
        internal_hs = add_health_and_reflection(internal_server, list(internal_services))
        internal_port = getattr(cfg, "internal_port", 0)
        security.check_port(f"{name} internal port", cfg.host, internal=True)
        bound = bind(internal_server, cfg.host, internal_port, security.server_credentials(internal=True))
        internal_address = f"{cfg.host}:{bound}"
    metrics_port = telemetry.metrics.serve(cfg.host, cfg.metrics_port)
    shutdown.serving()
    server.start()
    if internal_server is not None:
        internal_server.start()
    set_serving(hs, service_names, True)
    if internal_hs is not None:
        set_serving(internal_hs, list(internal_services), True)
    if public is not None:
        log.info(
            "%s: public API auth %s",
            name,
            f"on ({len(public.tenants)} tenants)"
            if public.enabled
            else 'OFF (no token list): every caller is tenant "default"',
        )
    log.info("%s: up to %d concurrent streams, %d control threads", name, gate.limit, cfg.control_threads)
    if cfg.gc_freeze:  # everything loaded (engine, graphs, warm-up): out of the full collections' walk
        frozen, took = freeze_startup_heap()
        log.info("%s: %d start-up objects frozen out of the garbage collector (a full collection of them: %.1f ms)",
                 name, frozen, took * 1e3)  # fmt: skip
    gc_pauses = GcPauses(telemetry.metrics.gc_pause, cfg.gc_warn_ms / 1e3, name).install()  # serving's pauses
    telemetry.metrics.gauge("gc_frozen_objects", "Objects frozen out of the garbage collector (--gc-freeze)",
                            gc.get_freeze_count)  # fmt: skip
    announce_ready(
        name,
        f"{cfg.host}:{port}",
        cfg.ready_file or None,
        metrics=f"{cfg.host}:{metrics_port}" if metrics_port is not None else None,
        internal=internal_address,
    )
    announcer = None
    router = getattr(cfg, "router", "")  # only services that register with a router have this field
    if router:  # register with the router and heartbeat (pdserve.server.announce)
        from pdserve.server.announce import Announcer, advertised

        model_dir = getattr(cfg, "model", "")  # the served model it announces (pdserve.router.catalog)
        announcer = Announcer(
            router,
            name,
            advertised(cfg.host, port),
            security=security.channel(),
            model_name=getattr(cfg, "served_model_name", ""),
            model_path=str(Path(model_dir).resolve()) if model_dir else "",
        ).start()

    shutdown.wait()
    log.info("%s draining (grace %.1fs)", name, cfg.drain_grace_s)
    if announcer is not None:
        announcer.stop()  # the router stops sending new work before we stop serving
    set_serving(hs, service_names, False)
    gate.close()
    server.stop(grace=cfg.drain_grace_s + DRAIN_END_MARGIN_S)  # new calls refused now; whatever is left cut then
    if not gate.wait_idle(cfg.drain_grace_s):
        log.warning("%s: drain grace over: ending %d streams (UNAVAILABLE)", name, gate.end_all())
        gate.wait_idle(DRAIN_END_MARGIN_S)
    # Idle means every stream's handler returned; its last messages and status may still be on their way. A short
    # grace (not 0, which cancels them) lets gRPC send them; the wait returns as soon as every call is done.
    server.stop(DRAIN_END_MARGIN_S).wait()
    if internal_server is not None:
        internal_server.stop(0).wait()
    cleanup()
    gc_pauses.remove()
    telemetry.shutdown()  # flushes batched spans
    log.info("%s stopped", name)
