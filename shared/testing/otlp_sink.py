"""A minimal OTLP/gRPC trace receiver (the collector's TraceService) that keeps spans in memory: the real wire
protocol the services export with, for tests and benchmarks that have no collector to run.

    with OTLPSink() as sink:            # listens on 127.0.0.1:<free port>
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        ...
        spans = sink.wait_for(lambda spans: len(spans) >= 3, timeout=10)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class SpanRecord:
    service: str
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_id: str  # 16 hex, "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    event_ns: list[int] = field(default_factory=list)  # each event's time (epoch ns), in the order of `events`


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OTLPSink):
        self.sink = sink

    def Export(self, request, context):
        records = []
        for rs in request.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    records.append(
                        SpanRecord(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.kind,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            _attrs(s.attributes),
                            s.status.code,
                            s.status.message,
                            [(e.name, _attrs(e.attributes)) for e in s.events],
                            [e.time_unix_nano for e in s.events],
                        )
                    )
        self.sink._add(records)
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPSink:
    def __init__(self, host: str = "127.0.0.1"):
        self._cv = threading.Condition()
        self._spans: list[SpanRecord] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"

    def _add(self, records: list[SpanRecord]) -> None:
        with self._cv:
            self._spans.extend(records)
            self._cv.notify_all()

    def spans(self) -> list[SpanRecord]:
        with self._cv:
            return list(self._spans)

    def clear(self) -> None:
        with self._cv:
            self._spans.clear()

    def wait_for(self, done: Callable[[list[SpanRecord]], bool], timeout: float) -> list[SpanRecord]:
        """Block until `done(spans)` holds (returns the spans) or `timeout` seconds pass (TimeoutError)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not done(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"OTLP sink: condition not met after {timeout}s ({len(self._spans)} spans)")
                self._cv.wait(left)
            return list(self._spans)

    def start(self) -> OTLPSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait()

    def __enter__(self) -> OTLPSink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
