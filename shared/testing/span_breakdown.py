"""Where a served request's time goes, from the services' own spans: for each span name (per service) the median
start offset from the trace's root span and the median duration, plus each hop's first-token event and the other
events its spans mark (a stage of a hop, e.g. prefill's "admitted").

    sink = OTLPSink().start()          # the services export to it (OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint)
    ... requests through the router ...
    table = breakdown(sink.spans())    # {"pdserve-prefill/prefill.chunk": Row(start_ms, dur_ms, n), ...}
    print(format_breakdown(table))

A benchmark puts this table beside its TTFT figures, so the gap between the served TTFT and the in-process engine's
has names: queueing before a hop, a transfer, an engine-thread hand-off.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pdserve.testing.otlp_sink import SpanRecord

ROOT = "router.generate"  # the span a request's trace starts with at the router


@dataclass
class Row:
    start_ms: float  # median offset of the span's start from its trace's root span start
    dur_ms: float  # median duration
    n: int  # traces the span appeared in


def breakdown(spans: Iterable[SpanRecord], root: str = ROOT) -> dict[str, Row]:
    """Rows keyed "service/span name", "service/span name@first_token" for a span's first_token event (its offset
    is start_ms, dur_ms is 0) and "service/span name@event" for its other events (their own times; a name repeated
    within a span counts once, at its first time). Traces without a `root` span are skipped (e.g. health checks)."""
    traces: dict[str, list[SpanRecord]] = {}
    for sp in spans:
        traces.setdefault(sp.trace_id, []).append(sp)
    offsets: dict[str, list[float]] = {}
    durations: dict[str, list[float]] = {}
    for trace in traces.values():
        roots = [sp for sp in trace if sp.name == root and not sp.parent_id]
        if len(roots) != 1:
            continue
        t0 = roots[0].start_ns
        for sp in trace:
            key = f"{sp.service}/{sp.name}"
            offsets.setdefault(key, []).append((sp.start_ns - t0) / 1e6)
            durations.setdefault(key, []).append((sp.end_ns - sp.start_ns) / 1e6)
            ttft = next((attrs for name, attrs in sp.events if name == "first_token"), None)
            if ttft is not None and "pdserve.ttft_ms" in ttft:
                ev = f"{key}@first_token"
                offsets.setdefault(ev, []).append((sp.start_ns - t0) / 1e6 + float(ttft["pdserve.ttft_ms"]))
                durations.setdefault(ev, []).append(0.0)
            seen = {"first_token"}
            for (name, _), at_ns in zip(sp.events, sp.event_ns, strict=False):
                if name in seen:
                    continue
                seen.add(name)
                offsets.setdefault(f"{key}@{name}", []).append((at_ns - t0) / 1e6)
                durations.setdefault(f"{key}@{name}", []).append(0.0)
    return {
        k: Row(statistics.median(offsets[k]), statistics.median(durations[k]), len(offsets[k]))
        for k in sorted(offsets, key=lambda k: statistics.median(offsets[k]))
    }


def format_breakdown(table: dict[str, Row]) -> str:
    """The table as text lines, in order of start."""
    lines = [f"  {'span':52s} {'start ms':>9s} {'dur ms':>9s}   n"]
    lines += [f"  {k:52s} {r.start_ms:9.2f} {r.dur_ms:9.2f} {r.n:3d}" for k, r in table.items()]
    return "\n".join(lines)


def as_json(table: dict[str, Row]) -> dict[str, dict]:
    return {k: asdict(r) for k, r in table.items()}
