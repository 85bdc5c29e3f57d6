"""`pdserve serve gateway`: run the OpenAI-compatible app under uvicorn (HTTP/1.1 over h11, with the read deadlines
of `connection.py` and uvicorn's connection and header-size limits) until SIGTERM/SIGINT."""

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
    from pdserve.router.gateway.connection import TimedH11Protocol

    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))  # bound here so that port 0 is known before announcing it
    port = sock.getsockname()[1]
    tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key} if cfg.tls_cert else {}
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(cfg),
            log_level=cfg.log_level.lower(),
            access_log=False,
            http=TimedH11Protocol.with_timeouts(cfg.header_timeout_s, cfg.body_timeout_s),
            timeout_keep_alive=cfg.keep_alive_s,  # type: ignore[arg-type]  # used as a float (loop.call_later)
            # uvicorn answers 503 once its connections (this one included) reach the limit
            limit_concurrency=cfg.max_connections + 1,
            h11_max_incomplete_event_size=cfg.max_header_kb * 1024,
            **tls,  # type: ignore[arg-type]
        )
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
