"""gRPC plumbing shared by the three services: server construction, health, reflection, readiness."""

from __future__ import annotations

import json
import logging
import os
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


def make_server(max_workers: int, max_concurrent_rpcs: int) -> grpc.Server:
    """A threaded server; RPCs beyond `max_concurrent_rpcs` get RESOURCE_EXHAUSTED instead of queueing."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=CHANNEL_OPTIONS,
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


def add_health_and_reflection(server: grpc.Server, service_full_names: list[str]) -> health.HealthServicer:
    """Register grpc.health.v1 and server reflection; services start NOT_SERVING until marked ready."""
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for name in ["", *service_full_names]:
        hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return hs


def set_serving(hs: health.HealthServicer, service_full_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_full_names]:
        hs.set(name, status)


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Bind insecure; port 0 picks a free port. Returns the bound port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"could not bind {host}:{port}")
    return bound


def announce_ready(service: str, address: str, ready_file: str | None, metrics: str | None = None) -> None:
    """Tell a supervisor (`pdserve up`, tests) where this service listens (and serves /metrics), once it can serve."""
    line = f"PDSERVE_READY {service} {address}" + (f" metrics={metrics}" if metrics else "")
    print(line, flush=True)
    log.info("%s ready on %s", service, address)
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        info = {"service": service, "address": address, "pid": os.getpid()}
        if metrics:
            info["metrics"] = metrics
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the caller's deadline (None when the caller set none)."""
    t = context.time_remaining()
    return None if t is None or t > 1e8 else max(t, 0.0)
