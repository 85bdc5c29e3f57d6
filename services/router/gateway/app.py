"""The FastAPI application: OpenAI routes over `pdserve.AsyncClient`, errors mapped from the router's status."""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.client import AsyncClient, CompletionChunk, PromptLogprobs, TokenLogprob
from pdserve.client_retry import RetryPolicy
from pdserve.router.gateway import logprobs, models, protocol, tools
from pdserve.router.gateway.config import GatewayConfig
from pdserve.router.gateway.errors import (
    APIError,
    api_error_response,
    error_body,
    http_error_response,
    param_aliases,
    rpc_error_response,
    rpc_error_status,
)
from pdserve.router.gateway.inbound import forwarded_metadata, parse_json, read_body
from pdserve.router.gateway.metrics import CountRequests, GatewayMetrics
from pdserve.router.gateway.model_cache import ModelListCache

GENERATION_SERVICE = "pdserve.v1.Generation"
log = logging.getLogger("pdserve.gateway")


def _internal_error(where: str) -> dict:
    """Log the exception being handled (its traceback goes to the gateway's log only); the client's error body
    carries an id to find it there."""
    eid = uuid.uuid4().hex[:12]
    log.exception("internal error %s in %s", eid, where)
    message = f"internal error (id {eid}); the gateway's log has the details"
    return error_body(message, "server_error", code="internal_error")


class CatchUnexpected:
    """ASGI middleware: an exception no handler mapped becomes a logged 500 in the OpenAI error shape (after the
    response started, it is logged and the connection closed), never a traceback sent to the client."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            body = _internal_error(f"{scope['method']} {scope['path']}")
            if not started:
                await JSONResponse(body, status_code=500)(scope, receive, send)


async def _body(request: Request, cfg: GatewayConfig) -> dict:
    raw = await read_body(request, int(cfg.max_body_mb * 1024 * 1024), cfg.body_timeout_s)
    body = parse_json(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' must be given, as a string", param="model", code="invalid_type")
    return body


@dataclass(frozen=True)
class _Shape:
    """How one request's results are presented: chat or completions, logprobs asked, echo (completions)."""

    chat: bool
    logprobs: bool
    prompt_text: str | None  # echo of a text prompt
    echo: bool

    def echo_text(self, prompt: PromptLogprobs | None) -> str:
        if not self.echo:
            return ""
        if self.prompt_text is not None:
            return self.prompt_text
        return "".join(prompt.tokens) if prompt is not None else ""  # a token-id prompt: its tokens' text

    def logprobs_json(self, lps: list[TokenLogprob] | None, prompt: PromptLogprobs | None, offset: int) -> dict | None:
        if not self.logprobs or (not lps and prompt is None):
            return None
        if self.chat:
            return logprobs.chat_logprobs_json(lps or [])
        return logprobs.completion_logprobs_json(lps or [], prompt if self.echo else None, offset)


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _aliases(request: Request) -> dict[str, str] | None:
    """The request's `param_aliases` (set once its body was read): names the field in router 400s."""
    return getattr(request.state, "param_aliases", None)


def create_app(cfg: GatewayConfig) -> FastAPI:
    """The gateway app (and its `/metrics`); its router client lives as long as the app (lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ca = cfg.router_tls_ca()
        tls = bool(ca) or cfg.router_tls
        retry = RetryPolicy(max_wait_s=cfg.pushback_wait_s) if cfg.pushback_wait_s > 0 else False
        async with AsyncClient(
            cfg.router, timeout=cfg.request_timeout_s, tls=tls, tls_ca=ca or None, retry=retry
        ) as client:
            app.state.client = client
            app.state.models = ModelListCache(  # the router's models per credential, briefly (model_cache.py)
                functools.partial(models.router_models, client), cfg.models_cache_s, cfg.models_cache_size
            )
            app.state.health_channel = (
                grpc.aio.secure_channel(cfg.router, grpc.ssl_channel_credentials(Path(ca).read_bytes() if ca else None))
                if tls
                else grpc.aio.insecure_channel(cfg.router)
            )
            try:
                yield
            finally:
                await app.state.health_channel.close()

    app = FastAPI(title="pdserve OpenAI-compatible gateway", lifespan=lifespan)
    metrics = GatewayMetrics()
    app.add_middleware(CatchUnexpected)
    app.add_middleware(CountRequests, metrics=metrics)  # outermost: it sees CatchUnexpected's 500s

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return api_error_response(e)

    @app.exception_handler(grpc.RpcError)
    async def _rpc_error(request: Request, e: grpc.RpcError) -> JSONResponse:
        return rpc_error_response(e, _aliases(request))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return http_error_response(request.method, request.url.path, e.status_code, e.detail, e.headers)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        """Prometheus text (`metrics.py`): requests by route and status, latency histogram."""
        return metrics.response(request)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 once the router's Generation service answers its health check as SERVING."""
        stub = health_pb2_grpc.HealthStub(app.state.health_channel)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=2)
            serving = r.status == health_pb2.HealthCheckResponse.SERVING
            reason = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            serving, reason = False, f"router {cfg.router}: {e.code().name}"
        if serving:
            return JSONResponse({"status": "ready"})
        return JSONResponse(error_body(f"not ready: {reason}", "service_unavailable_error"), status_code=503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        """Every model the router serves (`models.listed`)."""
        names = await models.router_models(app.state.client, forwarded_metadata(request))
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": 0, "owned_by": "pdserve"}
                for n in models.listed(names, cfg.model_name)
            ],
        }

    async def complete(request: Request, chat: bool):
        metadata = forwarded_metadata(request)
        body = await _body(request, cfg)
        names = await app.state.models.get(metadata)  # which model it runs on (models.py; cached per caller)
        model = body["model"]
        kw_model = {"model": models.forward_name(model, names, cfg.model_name)}
        aliases = request.state.param_aliases = param_aliases(body, chat)
        if chat:
            inputs: dict[str, Any] = {"messages": protocol.chat_messages(body), **tools.tool_args(body)}
            echo = False
            lp_args = logprobs.chat_logprob_args(body)
        else:
            inputs = protocol.completion_input(body)
            lp_args, echo = logprobs.completion_logprob_args(body, prompt_is_text="prompt" in inputs)
        kw = {**inputs, **protocol.sampling_args(body, chat), **lp_args, **kw_model}
        prompt_text = inputs["prompt"] if echo and "prompt" in inputs else None
        shape = _Shape(chat, bool(lp_args.get("logprobs")), prompt_text, echo)
        stream, include_usage = protocol.stream_flags(body)
        rid = uuid.uuid4().hex
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        client: AsyncClient = app.state.client
        if not stream:
            out = await client.generate(request_id=rid, metadata=metadata, **kw)
            echo_text = shape.echo_text(out.prompt_logprobs)
            prompt_lps = out.prompt_logprobs  # on the response (choice 0 with n > 1)
            return JSONResponse(
                protocol.completion_json(
                    oid, model, out, chat, echo_text, lambda c: shape.logprobs_json(c.logprobs, prompt_lps, 0)
                )
            )
        chunks = client.stream(request_id=rid, metadata=metadata, **kw)
        try:  # the first chunk decides the HTTP status: errors before it are plain HTTP errors
            first = await anext(chunks)
        except grpc.RpcError:
            await chunks.aclose()
            raise
        return StreamingResponse(
            _events(
                chunks, first, oid, shape, include_usage, aliases, bool(kw.get("stream_usage")), model, kw.get("n") or 1
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        chunks: AsyncGenerator[CompletionChunk, None],
        first: CompletionChunk,
        oid: str,
        shape: _Shape,
        include_usage: bool,
        aliases: dict[str, str],
        continuous_usage: bool = False,
        model: str = "",
        n: int = 1,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = model or cfg.model_name
        chat = shape.chat
        event = functools.partial(protocol.chunk_json, oid, model, created, chat)  # one choice's event, by its text
        try:
            if chat:  # the role comes first, alone, as OpenAI sends it (n > 1: each choice's)
                for index in range(n):
                    yield _sse(event("", role=True, index=index))
            chunk: CompletionChunk | None = first
            usage = None
            sent: dict[int, int] = {}  # characters of each choice's text sent (completions' text_offset)
            prompt_lps = first.prompt_logprobs  # on the stream's first chunk (whichever choice it is)
            while chunk is not None:
                text, i = chunk.text, chunk.index
                fresh = i not in sent  # this choice's first chunk
                if fresh:  # echo: the prompt leads each choice's text
                    text = shape.echo_text(prompt_lps) + text
                    sent[i] = 0
                lps = shape.logprobs_json(chunk.logprobs, prompt_lps if fresh else None, sent[i])
                running = chunk.usage if continuous_usage else None
                if text or chunk.reasoning_text or lps or chunk.tool_calls:
                    reasoning, calls = chunk.reasoning_text, chunk.tool_calls
                    yield _sse(event(text, logprobs=lps, reasoning=reasoning, usage=running, tool_calls=calls, index=i))
                    sent[i] += len(text)
                if chunk.finish_reason is not None:
                    usage = chunk.usage  # n > 1: the last one's is the request's
                    finish = event(None if chat else "", finish_reason=chunk.finish_reason, usage=running, index=i)
                    yield _sse(finish)
                chunk = await anext(chunks, None)
            if include_usage and usage is not None:
                yield _sse(protocol.usage_chunk_json(oid, model, created, chat, usage))
            yield _sse("[DONE]")
        except grpc.RpcError as e:  # after the stream started the status is sent: report it in-band
            yield _sse(rpc_error_status(e, aliases)[1])
        except Exception:
            yield _sse(_internal_error(f"the stream of {oid}"))
        finally:
            await chunks.aclose()  # cancels the router call when the HTTP client went away

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app
