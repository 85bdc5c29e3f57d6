"""The gateway's Prometheus metrics, served by the app itself at `GET /metrics` (text format, or OpenMetrics when
the scraper asks for `application/openmetrics-text`): `pdserve_gateway_requests_total{route, method, status}`
(HTTP status) and `pdserve_gateway_request_duration_seconds{route}` (until the last byte of the answer, streams
included). `route` is the matched route's path, or "unmatched" (unknown URLs cannot grow the label set). Each app
owns its registry (no process-global state)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.telemetry.metrics import LATENCY_BUCKETS

UNMATCHED = "unmatched"


class GatewayMetrics:
    """One gateway's request counter and latency histogram, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "pdserve_gateway_requests",
            "HTTP requests answered by the gateway, by route, method and HTTP status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "pdserve_gateway_request_duration_seconds",
            "HTTP request latency at the gateway, until the answer's last byte",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route).observe(seconds)

    def response(self, request: Request) -> Response:
        """The `/metrics` answer, in the format the scraper's Accept header asks for."""
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(self.registry), media_type=content_type)


class CountRequests:
    """ASGI middleware: every HTTP request's route, method, final status and duration into `metrics` (a request
    whose client went away before an answer counts as status 499)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 499

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            status = 500 if status == 499 else status
            raise
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or UNMATCHED
            self.metrics.observe(path, scope["method"], status, time.perf_counter() - t0)
