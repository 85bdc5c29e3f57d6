"""`pdserve serve router`: the public Generation endpoint (`--port`, bearer tokens → tenants) and, on the internal
port (`--internal-port`, internal identity required), the Registry instances announce themselves to."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pdserve.router.config import RouterConfig
from pdserve.server.auth import Authenticator
from pdserve.server.runner import run_service
from pdserve.telemetry.metrics import watch_pools
from pdserve.v1 import generate_pb2, router_admin_pb2, router_admin_pb2_grpc

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
REGISTRY = router_admin_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
log = logging.getLogger("pdserve.router")


def serve(cfg: RouterConfig) -> None:
    from pdserve.models.generation_config import GenerationDefaults
    from pdserve.router.catalog import model_id
    from pdserve.router.instances import COLOCATED
    from pdserve.router.registry import RegistryServicer
    from pdserve.router.servicer import RouterServicer, add_generation_servicer
    from pdserve.router.slo import register_metrics as register_slo_metrics
    from pdserve.router.tokenizer import load_tokenizer

    auth = Authenticator.from_config(cfg.auth_tokens_file, os.environ)
    tokenizer = load_tokenizer(cfg.model)
    model_cfg = json.loads((Path(cfg.model) / "config.json").read_text())
    defaults = GenerationDefaults.from_model_dir(cfg.model)
    log.info("sampling defaults from the model's generation_config.json: %s", defaults.describe())

    def register(server, telemetry, internal):
        servicer = RouterServicer(
            cfg,
            tokenizer,
            max_model_len=int(model_cfg["max_position_embeddings"]),
            vocab_size=int(model_cfg["vocab_size"]),
            telemetry=telemetry,
            model_id=model_id(cfg.model),
            tenant_of=auth.tenant_of,
            generation_defaults=defaults,
        )
        watch_pools(telemetry.metrics, servicer.prefill, servicer.decode, servicer.scheduler.view(COLOCATED))
        register_slo_metrics(telemetry.metrics, servicer.scheduler)
        telemetry.metrics.gauge(
            "queue_depth", "Requests in the router's priority queue", lambda: len(servicer.scheduler.queue)
        )
        register_model_metrics(telemetry.metrics, servicer)
        add_generation_servicer(servicer, server)  # malformed requests (bad UTF-8): INVALID_ARGUMENT
        router_admin_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(servicer.membership, servicer.estimator, cfg.pcs_fallback_mode), internal
        )
        servicer.start()
        return servicer.close

    run_service("router", cfg, [SERVICE], register, public=auth, internal_services=[REGISTRY])


def register_model_metrics(metrics, servicer) -> None:
    """Per-model router gauges: `pdserve_instance_model{role,address,model}` (1 per known instance: join the
    per-instance series on `address` to group them by model) and `pdserve_model_queue_depth{model}`."""
    sched = servicer.scheduler

    def instance_models() -> dict[tuple[str, ...], float]:
        with sched.lock:
            return {(r, i.address, i.model): 1.0 for r, insts in sched.instances.items() for i in insts.values()}

    def queue_depths() -> dict[tuple[str, ...], float]:
        models = servicer.served_models()  # takes the scheduler's lock itself
        with sched.lock:
            return {(m,): float(sched.queue.depth(m)) for m in models}

    metrics.gauge("instance_model", "The model each instance serves (1)", instance_models, ["role", "address", "model"])
    metrics.gauge("model_queue_depth", "Requests in the router's queue per model", queue_depths, ["model"])
