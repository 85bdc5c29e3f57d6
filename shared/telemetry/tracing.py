"""OpenTelemetry tracing for one service: the SDK configured from the standard OTEL_* variables, W3C trace context
carried in gRPC metadata, and spans started with explicit parents (no ambient context: handlers yield across
threads and the prefill engine reports chunks on its own thread).

On when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) or
`OTEL_TRACES_EXPORTER=console`; off when `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Off means a
no-op tracer, no SDK import, and the caller's `traceparent`/`tracestate` passed through to the next hop unchanged.
The sampler comes from `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` (default: parentbased_always_on), batching
from `OTEL_BSP_*`, the exporter from `OTEL_EXPORTER_OTLP_*`. `service.name` is `pdserve-<service>` (it overrides
OTEL_SERVICE_NAME, which one shell would otherwise give all three services); OTEL_RESOURCE_ATTRIBUTES add to it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

log = logging.getLogger("pdserve.telemetry.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")
Attributes = Mapping[str, Any]


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter == "none":
        return False
    if exporter == "console":
        return True
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter(kind: str):
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise SystemExit(f"OTEL_TRACES_EXPORTER={kind!r} is not supported (otlp, console or none)")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, TLS, timeout, compression: OTEL_EXPORTER_OTLP_*


class Tracing:
    """Spans of one service. `enabled` False: every method is a cheap no-op returning INVALID_SPAN."""

    def __init__(self, service: str, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.service = service
        self.enabled = tracing_enabled(env)
        self._provider = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
        resource = Resource.create({"service.name": f"pdserve-{service}", "service.namespace": "pdserve"})
        self._provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER(_ARG)
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(kind)))  # OTEL_BSP_* settings
        self.tracer = self._provider.get_tracer(f"pdserve.{service}")
        log.info(
            "tracing on: service.name=pdserve-%s exporter=%s sampler=%s",
            service,
            kind,
            type(self._provider.sampler).__name__,
        )

    # ---- spans -----------------------------------------------------------------------------------------
    def server_span(self, name: str, invocation_metadata, attributes: Attributes | None = None) -> Span:
        """A SERVER span continuing the trace of the caller's `traceparent` (a new trace without one)."""
        if not self.enabled:
            return INVALID_SPAN
        parent = propagate.extract(dict(invocation_metadata or ()))
        return self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)

    def child(
        self, name: str, parent: Span, attributes: Attributes | None = None, start_time_ns: int | None = None
    ) -> Span:
        """A child of `parent`; `start_time_ns` (epoch ns) for spans recorded after the fact."""
        if not self.enabled or not parent.is_recording():
            return INVALID_SPAN
        return self.tracer.start_span(
            name, context=trace.set_span_in_context(parent), attributes=attributes, start_time=start_time_ns
        )

    def outgoing_metadata(self, span: Span, invocation_metadata=None) -> list[tuple[str, str]]:
        """gRPC metadata for the next hop: `span` as the parent; when off, the caller's trace headers as given."""
        if self.enabled:
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            return list(carrier.items())
        return [(k, v) for k, v in (invocation_metadata or ()) if k in TRACE_HEADERS]

    def shutdown(self) -> None:
        """Export every finished span still batched, then stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()


def end_span(span: Span, status: str = "OK", details: str = "", end_time_ns: int | None = None) -> None:
    """End `span`; a gRPC status other than OK marks it as an error with the status name and reason."""
    if not span.is_recording():
        return
    span.set_attribute("rpc.grpc.status", status)
    if status != "OK":
        span.set_status(Status(StatusCode.ERROR, f"{status}: {details}" if details else status))
    span.end(end_time_ns)


def trace_id_hex(span: Span) -> str | None:
    """32-hex trace id of a sampled span (for exemplars and logs), else None."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid and ctx.trace_flags.sampled else None
