"""span_breakdown: offsets from the root span, medians over traces, first-token events, traces without a root."""

from __future__ import annotations

from pdserve.testing.otlp_sink import SpanRecord
from pdserve.testing.span_breakdown import ROOT, breakdown, format_breakdown

MS = 1_000_000


def span(
    trace: str, service: str, name: str, start_ms: float, end_ms: float, parent="p", events=(), event_ms=()
) -> SpanRecord:
    return SpanRecord(
        service=service,
        name=name,
        trace_id=trace,
        span_id=f"{name}-{trace}",
        parent_id=parent,
        kind=0,
        start_ns=int(1e12 + start_ms * MS),
        end_ns=int(1e12 + end_ms * MS),
        attributes={},
        status_code=1,
        status_message="",
        events=list(events),
        event_ns=[int(1e12 + t * MS) for t in event_ms],
    )


def trace(tid: str, shift: float, prefill_ms: float) -> list[SpanRecord]:
    """One request: the root at `shift` (absolute times differ per trace, offsets must not)."""
    return [
        span(
            tid, "pdserve-router", ROOT, shift, shift + 50, parent="", events=[("first_token", {"pdserve.ttft_ms": 40})]
        ),
        span(tid, "pdserve-decode", "decode.request", shift + 2, shift + 49),
        span(tid, "pdserve-prefill", "prefill.chunk", shift + 5, shift + 5 + prefill_ms),
    ]


def test_offsets_are_from_each_trace_root_and_medians_over_traces():
    spans = trace("a", 0, 20) + trace("b", 1000, 30) + trace("c", 5000, 100)
    spans.append(span("health", "pdserve-decode", "grpc.health", 0, 1))  # no root: skipped
    table = breakdown(spans)
    assert list(table) == [
        f"pdserve-router/{ROOT}",
        "pdserve-decode/decode.request",
        "pdserve-prefill/prefill.chunk",
        f"pdserve-router/{ROOT}@first_token",
    ]
    chunk = table["pdserve-prefill/prefill.chunk"]
    assert (chunk.start_ms, chunk.dur_ms, chunk.n) == (5.0, 30.0, 3)
    assert table[f"pdserve-router/{ROOT}@first_token"].start_ms == 40.0
    assert "prefill.chunk" in format_breakdown(table)


def test_a_trace_with_two_roots_is_skipped():
    spans = trace("a", 0, 20) + [span("a", "pdserve-router", ROOT, 3, 9, parent="")] + trace("b", 0, 10)
    assert breakdown(spans)["pdserve-prefill/prefill.chunk"].n == 1


def test_stage_events_are_rows_at_their_own_times_first_one_of_a_name_counted():
    spans = []
    for tid, shift, admitted in (("a", 0, 3.0), ("b", 700, 5.0), ("c", 9000, 4.0)):
        root = span(tid, "pdserve-router", ROOT, shift, shift + 50, parent="")
        marks = [("read", {}), ("admitted", {}), ("admitted", {})]
        times = [shift + 2.5, shift + admitted, shift + 40]
        request = span(tid, "pdserve-prefill", "prefill.request", shift + 2, shift + 45, events=marks, event_ms=times)
        spans += [root, request]
    table = breakdown(spans)
    admitted = table["pdserve-prefill/prefill.request@admitted"]
    assert (admitted.start_ms, admitted.dur_ms, admitted.n) == (4.0, 0.0, 3)  # the median of 3, 5, 4; not 40
    assert table["pdserve-prefill/prefill.request@read"].start_ms == 2.5
    assert list(table).index("pdserve-prefill/prefill.request@read") < list(table).index(
        "pdserve-prefill/prefill.request@admitted"
    )
