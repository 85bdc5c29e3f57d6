"""`pdserve serve router`: the public Generation endpoint."""
from __future__ import annotations

import json
from pathlib import Path

from pdserve.metrics import watch_pools
from pdserve.router.config import RouterConfig
from pdserve.service_runner import run_service
from pdserve.v1 import generate_pb2, generate_pb2_grpc

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def serve(cfg: RouterConfig) -> None:
    from transformers import AutoTokenizer

    from pdserve.router.servicer import RouterServicer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model_cfg = json.loads((Path(cfg.model) / "config.json").read_text())

    def register(server, telemetry):
        servicer = RouterServicer(cfg, tokenizer, max_model_len=int(model_cfg["max_position_embeddings"]),
                                  vocab_size=int(model_cfg["vocab_size"]), telemetry=telemetry)
        watch_pools(telemetry.metrics, servicer.prefill, servicer.decode)
        generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return servicer.close

    run_service("router", cfg, [SERVICE], register)
