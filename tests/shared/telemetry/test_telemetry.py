"""pdserve.telemetry.service.RequestScope on a real gRPC server: the final status (OK, aborted, deadline,
cancelled) reaches
the span and the request counter, timings reach the histograms, and gauges return to zero."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from pdserve.telemetry.service import Telemetry
from pdserve.testing.otlp_sink import OTLPSink

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def handler(telemetry: Telemetry):
    def gen(request: bytes, context):
        scope = telemetry.request("svc.request", context, {"pdserve.mode": request.decode(), "skipped": None})
        if request == b"abort":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad input")
        child = scope.child("svc.step")
        time.sleep(0.01)
        scope.first_token()
        yield b"t1"
        if request == b"ok":
            scope.end_child(child, ok=True, attributes={"n": 1})
            time.sleep(0.02)
            scope.finish(3, "length")
            yield b"t2t3"
            return
        try:
            while context.is_active():  # until the client cancels or the deadline passes
                time.sleep(0.01)
        finally:
            scope.end_child(child)  # may run late (or at garbage collection): the scope ended it already

    return grpc.method_handlers_generic_handler("t.T", {"Gen": grpc.unary_stream_rpc_method_handler(gen)})


@pytest.fixture
def served(monkeypatch):
    with OTLPSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
        telemetry = Telemetry("svc")
        server = grpc.server(futures.ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers((handler(telemetry),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = ch.unary_stream("/t.T/Gen")
        yield telemetry, sink, call
        ch.close()
        server.stop(0).wait()
        telemetry.shutdown()


def value(telemetry: Telemetry, name: str, **labels) -> float:
    return telemetry.metrics.registry.get_sample_value(name, labels)


def test_final_status_reaches_span_and_metrics(served):
    telemetry, sink, call = served
    assert list(call(b"ok", metadata=[("traceparent", TRACEPARENT)], timeout=10)) == [b"t1", b"t2t3"]
    with pytest.raises(grpc.RpcError) as err:
        list(call(b"abort", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(call(b"slow", timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream = call(b"cancel", timeout=10)
    assert next(stream) == b"t1"
    stream.cancel()

    deadline = time.monotonic() + 5
    while value(telemetry, "pdserve_requests_in_flight") != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert value(telemetry, "pdserve_requests_in_flight") == 0
    assert value(telemetry, "pdserve_requests_awaiting_first_token") == 0
    for status in ("OK", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED"):
        assert value(telemetry, "pdserve_requests_total", status=status) == 1, status
    assert value(telemetry, "pdserve_request_ttft_seconds_count") == 3  # not the aborted one
    assert value(telemetry, "pdserve_request_tpot_seconds_count") == 1  # finished with > 1 token
    tpot = value(telemetry, "pdserve_request_tpot_seconds_sum")
    assert 0.02 / 2 <= tpot < 1.0  # (last - first) / (3 - 1) with >= 20 ms between them
    assert value(telemetry, "pdserve_request_e2e_seconds_count") == 4

    telemetry.tracing.shutdown()
    spans = sink.spans()
    requests = {s.attributes["pdserve.mode"]: s for s in spans if s.name == "svc.request"}
    assert {m: s.attributes["rpc.grpc.status"] for m, s in requests.items()} == {
        "ok": "OK",
        "abort": "INVALID_ARGUMENT",
        "slow": "DEADLINE_EXCEEDED",
        "cancel": "CANCELLED",
    }
    assert requests["ok"].status_code == 0 and requests["abort"].status_code == 2
    assert requests["abort"].status_message == "INVALID_ARGUMENT: bad input"
    assert requests["ok"].parent_id == "00f067aa0ba902b7"
    assert requests["ok"].attributes["pdserve.completion_tokens"] == 3
    assert "skipped" not in requests["ok"].attributes
    steps = {s.parent_id: s for s in spans if s.name == "svc.step"}
    assert steps[requests["ok"].span_id].attributes["rpc.grpc.status"] == "OK"
    assert steps[requests["slow"].span_id].attributes["rpc.grpc.status"] == "DEADLINE_EXCEEDED"
    assert steps[requests["cancel"].span_id].attributes["rpc.grpc.status"] == "CANCELLED"
    assert len(steps) == 3  # the aborted request never started one
