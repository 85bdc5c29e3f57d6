"""pdserve.telemetry.tracing: on/off from the OTEL_* environment, W3C context in and out of gRPC metadata,
export over real
OTLP/gRPC to an in-process TraceService receiver, flush on shutdown."""

from __future__ import annotations

import pytest
from opentelemetry.trace import INVALID_SPAN

from pdserve.telemetry.tracing import Tracing, end_span, trace_id_hex, tracing_enabled
from pdserve.testing.otlp_sink import OTLPSink

TID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TID}-{PARENT}-01"


@pytest.mark.parametrize(
    "env, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ],
)
def test_enabled_from_env(env, on):
    assert tracing_enabled(env) is on


def test_unknown_exporter_refused():
    with pytest.raises(SystemExit, match="zipkin"):
        Tracing("router", environ={"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:1"})


def test_off_records_nothing_and_passes_trace_headers_through():
    t = Tracing("router", environ={})
    md = [("traceparent", TRACEPARENT), ("tracestate", "k=v"), ("authorization", "secret")]
    span = t.server_span("router.generate", md, {"a": 1})
    assert span is INVALID_SPAN and not span.is_recording()
    assert t.child("c", span) is INVALID_SPAN
    assert t.outgoing_metadata(span, md) == [("traceparent", TRACEPARENT), ("tracestate", "k=v")]
    assert trace_id_hex(span) is None
    end_span(span, "INTERNAL", "x")  # no-op
    t.shutdown()


@pytest.fixture
def sink(monkeypatch):
    with OTLPSink() as s:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", s.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # only shutdown() exports
        monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
        yield s


def test_continues_caller_trace_exports_and_flushes_on_shutdown(sink):
    t = Tracing("decode")
    assert t.enabled
    span = t.server_span("decode.request", [("traceparent", TRACEPARENT)], {"pdserve.request_id": "r1"})
    assert trace_id_hex(span) == TID
    child = t.child("decode.kv_receive", span, {"pdserve.kv.pages": 3})
    md = dict(t.outgoing_metadata(child))
    own = format(child.get_span_context().span_id, "016x")
    assert md["traceparent"] == f"00-{TID}-{own}-01"  # the next hop's parent is the child span
    end_span(child, "DATA_LOSS", "bad page")
    end_span(span)
    assert sink.spans() == []  # batched, not yet exported
    t.shutdown()
    spans = {s.name: s for s in sink.spans()}
    req, recv = spans["decode.request"], spans["decode.kv_receive"]
    assert req.service == recv.service == "pdserve-decode"
    assert req.trace_id == recv.trace_id == TID and req.parent_id == PARENT and recv.parent_id == req.span_id
    assert req.kind == 2 and req.attributes["pdserve.request_id"] == "r1" and req.status_code == 0
    assert recv.status_code == 2 and recv.status_message == "DATA_LOSS: bad page"
    assert recv.attributes == {"pdserve.kv.pages": 3, "rpc.grpc.status": "DATA_LOSS"}


def test_new_trace_without_traceparent_and_explicit_start_time(sink):
    t = Tracing("prefill")
    span = t.server_span("prefill.request", [])
    chunk = t.child("prefill.chunk", span, start_time_ns=1_000)
    end_span(chunk, end_time_ns=2_000)
    end_span(span)
    t.shutdown()
    spans = {s.name: s for s in sink.spans()}
    assert spans["prefill.request"].parent_id == "" and len(spans["prefill.request"].trace_id) == 32
    assert (spans["prefill.chunk"].start_ns, spans["prefill.chunk"].end_ns) == (1_000, 2_000)


def test_sampler_from_env(sink, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    t = Tracing("router")
    span = t.server_span("router.generate", [])
    assert not span.is_recording() and trace_id_hex(span) is None
    flags = dict(t.outgoing_metadata(span))["traceparent"].rsplit("-", 1)[1]
    assert int(flags, 16) & 1 == 0  # "not sampled" travels on
    end_span(span)
    t.shutdown()
    assert sink.spans() == []
