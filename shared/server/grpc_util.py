"""gRPC plumbing shared by the three services: server construction, health, reflection, readiness."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.server.security import ChannelSecurity

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
# Every channel (the SDK's to a router, pdserve's own between instances) reconnects quickly to a peer that restarts
# on its address: gRPC's default backoff grows by 1.6x per failed attempt up to 120 s, so a client whose router or a
# decode whose prefill was down for ten seconds would keep failing UNAVAILABLE for ~5 s more after it is back.
CHANNEL_OPTIONS = [
    *SERVER_OPTIONS,
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A synchronous channel's server-streaming calls (the router reading decode's tokens, the SDK's `Client.stream`)
# receive on the thread that iterates them instead of through the channel's spin thread: one thread hand-off less
# per message (bench/diag/grpc_hop.py). Their `code()`, `details()` and `trailing_metadata()` then answer only once
# the call has ended, which is when pdserve reads them. grpc.aio channels have no such option.
SYNC_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


def make_server(
    max_workers: int,
    max_concurrent_rpcs: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> grpc.Server:
    """A threaded server; RPCs beyond `max_concurrent_rpcs` get RESOURCE_EXHAUSTED instead of queueing, a message
    over `max_receive_bytes` RESOURCE_EXHAUSTED before it is parsed."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes)],
        interceptors=list(interceptors),
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


def bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind (TLS with `credentials`, else plaintext); port 0 picks a free port. Returns the bound port."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise SystemExit(f"could not bind {host}:{port}")
    return bound


def announce_ready(
    service: str, address: str, ready_file: str | None, metrics: str | None = None, internal: str | None = None
) -> None:
    """Tell a supervisor (`pdserve up`, tests) where this service listens (and serves /metrics, and, for the router,
    its internal port), once it can serve: `PDSERVE_READY <service> <host:port> [internal=..] [metrics=..]`."""
    extra = (f" internal={internal}" if internal else "") + (f" metrics={metrics}" if metrics else "")
    # one write of the whole line: print's text and newline are two writes on an unbuffered stdout
    # (PYTHONUNBUFFERED), between which another process sharing the pipe (a tensor-parallel rank) could log
    print(f"PDSERVE_READY {service} {address}{extra}\n", end="", flush=True)
    log.info("%s ready on %s%s", service, address, f" (internal {internal})" if internal else "")
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        info = {"service": service, "address": address, "pid": os.getpid()}
        if metrics:
            info["metrics"] = metrics
        if internal:
            info["internal_address"] = internal
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)


def channel(
    target: str, security: ChannelSecurity | None = None, options: Sequence[tuple[str, Any]] = SYNC_CHANNEL_OPTIONS
) -> grpc.Channel:
    """A channel to an internal service. `security` None: the stack-wide identity of this process's environment
    (`ChannelSecurity.from_env`: $PDSERVE_INTERNAL_TOKEN, $PDSERVE_TLS_*); services pass their own."""
    return (security or ChannelSecurity.from_env()).open(target, options)


def remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the caller's deadline (None when the caller set none)."""
    t = context.time_remaining()
    return None if t is None or t > 1e8 else max(t, 0.0)
