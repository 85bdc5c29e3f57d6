"""Per-service telemetry (tracing + metrics) and the per-RPC `RequestScope` the servicers use in a line or two:

    req = self.telemetry.request("decode.request", context, {"pdserve.request_id": rid})
    ...  req.child(...), req.set(...), req.outgoing_metadata(), req.first_token(), req.finish(n, "stop")

The scope ends at `finish()` (status OK) or else when the RPC terminates (a gRPC termination callback): it ends
the server span with the final status, and counts and times the request. Status without `finish()`: the code the
handler aborted with; else DEADLINE_EXCEEDED when the deadline has passed; else CANCELLED (the client went away,
or an unhandled error that gRPC logged).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry.trace import Span

from pdserve.telemetry.metrics import ServiceMetrics
from pdserve.telemetry.tracing import Tracing, end_span, trace_id_hex


class Telemetry:
    def __init__(self, service: str, environ: Mapping[str, str] | None = None):
        self.service = service
        self.tracing = Tracing(service, environ)
        self.metrics = ServiceMetrics(service)

    @classmethod
    def off(cls, service: str) -> Telemetry:
        """Tracing off, metrics kept in memory only (servicers built outside `run_service`, e.g. in tests)."""
        return cls(service, environ={})

    def request(
        self, name: str, context: grpc.ServicerContext, attributes: Mapping[str, Any] | None = None
    ) -> RequestScope:
        return RequestScope(self, name, context, attributes)

    def rpc_span(
        self, name: str, context: grpc.ServicerContext, attributes: Mapping[str, Any] | None = None
    ) -> RpcSpan:
        return RpcSpan(self, name, context, attributes)

    def shutdown(self) -> None:
        self.metrics.stop()
        self.tracing.shutdown()


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


class RpcSpan:
    """The server span of a short RPC that is no request in the service's metrics (prefill's `Start`): child spans
    recorded after the fact, then `end`."""

    def __init__(
        self, telemetry: Telemetry, name: str, context: grpc.ServicerContext, attributes: Mapping[str, Any] | None
    ):
        self._t = telemetry
        self.span: Span = telemetry.tracing.server_span(name, context.invocation_metadata(), _clean(attributes))

    def record(
        self, name: str, start_time_ns: int, attributes: Mapping[str, Any] | None = None, end_time_ns: int | None = None
    ) -> None:
        """A finished child span from `start_time_ns` (epoch ns) to `end_time_ns` (default now)."""
        if self.span.is_recording():
            end_span(self._t.tracing.child(name, self.span, _clean(attributes), start_time_ns), end_time_ns=end_time_ns)

    def end(self, attributes: Mapping[str, Any] | None = None) -> None:
        if self.span.is_recording():
            self.span.set_attributes(_clean(attributes))
        end_span(self.span)


class RequestScope:
    """One RPC: its server span, timing and metrics."""

    def __init__(
        self,
        telemetry: Telemetry,
        name: str,
        context: grpc.ServicerContext,
        attributes: Mapping[str, Any] | None = None,
    ):
        self._t = telemetry
        self._context = context
        self.t0 = time.perf_counter()
        self.span: Span = telemetry.tracing.server_span(name, context.invocation_metadata(), _clean(attributes))
        self.recording = self.span.is_recording()
        self.ttft_s: float | None = None
        self._last_s: float | None = None
        self._tokens = 0
        self._finished = False
        self._ended = False
        self._children: list[Span] = []  # ended with the request at the latest (handlers may never resume)
        self._lock = threading.Lock()  # first_token (RPC thread) vs _end (gRPC callback thread)
        telemetry.metrics.in_flight.inc()
        telemetry.metrics.awaiting_first.inc()
        if not context.add_callback(self._end):  # already terminated
            self._end()

    # ---- spans -----------------------------------------------------------------------------------------
    def set(self, attributes: Mapping[str, Any]) -> None:
        """Set span attributes (None values skipped)."""
        if self.recording:
            self.span.set_attributes(_clean(attributes))

    def child(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        start_time_ns: int | None = None,
        parent: Span | None = None,
    ) -> Span:
        """A child span (of `parent`, default the request span); end it with `end_child`. One still open when the
        request ends is ended with the request's status (a cancelled gRPC generator may never run its `finally`)."""
        span = self._t.tracing.child(name, parent or self.span, _clean(attributes), start_time_ns)
        if span.is_recording():
            with self._lock:
                self._children.append(span)
        return span

    def end_child(self, span: Span, ok: bool = False, attributes: Mapping[str, Any] | None = None) -> None:
        """End a child span: OK, or (not `ok`, e.g. from a `finally`) with the status the RPC aborted with, else
        CANCELLED. A span already ended is left as it is, so the success path and a `finally` can both call this."""
        if not span.is_recording():
            return
        span.set_attributes(_clean(attributes))
        end_span(span, *(("OK", "") if ok else self._failure()))

    def record(
        self, name: str, start_time_ns: int, attributes: Mapping[str, Any] | None = None, end_time_ns: int | None = None
    ) -> None:
        """A finished child span from `start_time_ns` (epoch ns) to `end_time_ns` (default now); any thread (e.g. the
        engine's)."""
        if self.recording:
            end_span(self.child(name, attributes, start_time_ns), end_time_ns=end_time_ns)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        if self.recording:
            self.span.add_event(name, _clean(attributes))

    def outgoing_metadata(self, parent: Span | None = None) -> list[tuple[str, str]]:
        """Metadata for the next hop's call: trace context with `parent` (default the request span) as parent."""
        return self._t.tracing.outgoing_metadata(parent or self.span, self._context.invocation_metadata())

    # ---- progress ----------------------------------------------------------------------------------------
    def first_token(self) -> None:
        """The first output token exists (prefill: the prefill result); records TTFT once."""
        with self._lock:
            if self.ttft_s is not None or self._ended:
                return
            self.ttft_s = self._last_s = time.perf_counter() - self.t0
            self._t.metrics.awaiting_first.dec()
        self.event("first_token", {"pdserve.ttft_ms": round(self.ttft_s * 1e3, 3)})

    def finish(self, num_tokens: int, reason: str, attributes: Mapping[str, Any] | None = None) -> None:
        """The request completed with `num_tokens` output tokens (its last message is ready): ends the scope as OK
        now, so that a hop's span ends before its caller's does (gRPC's termination callback can lag)."""
        self._last_s = time.perf_counter() - self.t0
        self._tokens, self._finished = num_tokens, True
        self.set({"pdserve.completion_tokens": num_tokens, "pdserve.finish_reason": reason, **(attributes or {})})
        self._end()

    # ---- end (gRPC termination callback) -----------------------------------------------------------------
    def _status(self) -> tuple[str, str]:
        code = self._context.code()
        if self._finished and code in (None, grpc.StatusCode.OK):
            return "OK", ""
        return self._failure()

    def _failure(self) -> tuple[str, str]:
        """Why the RPC did not (or has not yet) completed: its abort status, else deadline, else cancelled."""
        code = self._context.code()
        if code is not None and code != grpc.StatusCode.OK:
            details = self._context.details()
            return code.name, details.decode(errors="replace") if isinstance(details, bytes) else (details or "")
        remaining = self._context.time_remaining()
        if remaining is not None and remaining <= 0:
            return "DEADLINE_EXCEEDED", "deadline exceeded"
        return "CANCELLED", "ended before completion"

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        status, details = self._status()
        e2e = time.perf_counter() - self.t0
        tpot = None
        if self._finished and self._tokens > 1 and self.ttft_s is not None and self._last_s is not None:
            tpot = (self._last_s - self.ttft_s) / (self._tokens - 1)
        m = self._t.metrics
        m.in_flight.dec()
        if self.ttft_s is None:
            m.awaiting_first.dec()
        m.observe(status, e2e, self.ttft_s, tpot, trace_id_hex(self.span))
        with self._lock:
            children, self._children = self._children, []
        for span in children:
            end_span(span, status, details)  # no-op for those already ended
        end_span(self.span, status, details)
