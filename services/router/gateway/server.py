"""`pdserve serve gateway`: run the OpenAI-compatible app under uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import socket

from pdserve.router.gateway.config import GatewayConfig
from pdserve.server.grpc_util import announce_ready

log = logging.getLogger("pdserve.gateway")


async def _serve(cfg: GatewayConfig) -> None:
    import uvicorn

    from pdserve.router.gateway.app import create_app

    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))  # bound here so that port 0 is known before announcing it
    port = sock.getsockname()[1]
    tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key} if cfg.tls_cert else {}
    server = uvicorn.Server(
        uvicorn.Config(create_app(cfg), log_level=cfg.log_level.lower(), access_log=False, **tls)  # type: ignore[arg-type]
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        log.info("gateway for router %s serving model %r", cfg.router, cfg.model_name)
        announce_ready("gateway", f"{cfg.host}:{port}", cfg.ready_file or None)
    await task


def serve(cfg: GatewayConfig) -> None:
    asyncio.run(_serve(cfg))
