"""Tracing and metrics through three real processes: the services export OTLP/gRPC to a TraceService receiver
run here, requests carry a client `traceparent`, and every service's /metrics is scraped and parsed."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import urllib.request

import grpc
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

import pdserve
from pdserve.cli.launch import start_stack
from pdserve.testing.otlp_sink import OTLPSink

PAGE, CHUNK = 4, 8
PROMPT_LEN, MAX_TOKENS = 29, 6  # chunks [0,8) [8,16) [16,24) [24,29); 8 pages
SERVER, ERROR = 2, 2  # SpanKind.SERVER, StatusCode.ERROR in the OTLP protos


def traceparent(sampled: bool = True) -> tuple[str, str, str]:
    tid, sid = secrets.token_hex(16), secrets.token_hex(8)
    return tid, sid, f"00-{tid}-{sid}-{'01' if sampled else '00'}"


def scrape(address: str, openmetrics: bool = False) -> str:
    req = urllib.request.Request(f"http://{address}/metrics")
    if openmetrics:
        req.add_header("Accept", "application/openmetrics-text; version=1.0.0")
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus_client's text parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.fixture(scope="module")
def traced(tmp_path_factory, model_dir):
    """Run the requests, scrape metrics, stop the stack (spans are only flushed at shutdown: the batch delay
    is a minute), and hand back what the sink received."""
    workdir = tmp_path_factory.mktemp("stack-traced")
    with OTLPSink() as sink, pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
        mp.delenv("OTEL_SDK_DISABLED", raising=False)
        mp.delenv("OTEL_TRACES_EXPORTER", raising=False)
        mp.delenv("OTEL_TRACES_SAMPLER", raising=False)
        mp.delenv("REDIS_URL", raising=False)  # the prefill's prompt cache is in-process
        # the prompt cache's own spans and counters: the repeated prompt must reach its lookup, not the pool's
        # prefixes (tests/services/prefill/test_prefill_prompt_cache.py covers those)
        mp.setenv("PDSERVE_PREFILL_PREFIX_REUSE", "false")
        stack = start_stack(
            model_dir,
            workdir,
            kv_dtype="int8",
            page_size=PAGE,
            chunk_size=CHUNK,
            extra=["--num-pages", "256", "--torch-threads", "1"],
        )
        try:
            ok, bad, unsampled = traceparent(), traceparent(), traceparent(sampled=False)
            prompt = [5 + (7 * i) % 400 for i in range(PROMPT_LEN)]
            with pdserve.Client(stack.router, timeout=60) as c:
                out = c.generate(
                    token_ids=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    ignore_eos=True,
                    metadata=[("traceparent", ok[2])],
                )
                with pytest.raises(grpc.RpcError) as err:
                    c.generate(token_ids=prompt, temperature=-1.0, metadata=[("traceparent", bad[2])])
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                c.generate(token_ids=prompt, max_tokens=2, metadata=[("traceparent", unsampled[2])])
            streamed = traceparent()
            asyncio.run(stream_async(stack.router, prompt, streamed[2]))
            metrics_at = {
                json.loads(p.read_text())["service"]: json.loads(p.read_text())["metrics"]
                for p in workdir.glob("*.json")
            }
            expect = {"router": 4, "prefill": 3, "decode": 3}  # requests counted once their RPC has ended
            deadline = time.monotonic() + 10
            while True:
                texts = {svc: scrape(addr) for svc, addr in metrics_at.items()}
                counts = {
                    svc: sum(v for (n, _), v in samples(t).items() if n == "pdserve_requests_total")
                    for svc, t in texts.items()
                }
                if counts == expect or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            router_om = scrape(metrics_at["router"], openmetrics=True)
        finally:
            stack.stop()
        spans = sink.spans()
    return dict(
        spans=spans,
        ok=ok,
        bad=bad,
        unsampled=unsampled,
        stack=stack,
        out=out,
        texts=texts,
        router_om=router_om,
        counts=counts,
        streamed=streamed,
    )


async def stream_async(router: str, prompt: list[int], tp: str) -> None:
    async with pdserve.AsyncClient(router, timeout=60) as c:
        chunks = [
            ch
            async for ch in c.stream(
                token_ids=prompt, max_tokens=3, temperature=0, ignore_eos=True, metadata=[("traceparent", tp)]
            )
        ]
    assert chunks[-1].finish_reason == "length"


def by_name(spans, trace_id: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        if s.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def test_one_trace_across_services_with_parent_child_structure(traced):
    tid, client_span, _ = traced["ok"]
    trace = by_name(traced["spans"], tid)
    assert {s.service for ss in trace.values() for s in ss} == {"pdserve-router", "pdserve-decode", "pdserve-prefill"}
    (router,) = trace["router.generate"]
    (decode,) = trace["decode.request"]
    (recv,) = trace["decode.kv_receive"]
    (prefill,) = trace["prefill.request"]
    (ship,) = trace["prefill.kv_ship"]
    (lookup,) = trace["prefill.cache_lookup"]
    chunks = sorted(trace["prefill.chunk"], key=lambda s: s.attributes["pdserve.chunk.start"])
    assert router.parent_id == client_span and router.kind == decode.kind == prefill.kind == SERVER
    assert decode.parent_id == router.span_id
    assert recv.parent_id == decode.span_id
    assert prefill.parent_id == recv.span_id  # the Prefill bidi stream carries the trace context
    assert ship.parent_id == lookup.parent_id == prefill.span_id
    assert all(c.parent_id == prefill.span_id for c in chunks)
    # one span per chunk, no per-token spans
    ranges = [(c.attributes["pdserve.chunk.start"], c.attributes["pdserve.chunk.end"]) for c in chunks]
    assert ranges == [(0, 8), (8, 16), (16, 24), (24, 29)]
    assert sum(map(len, trace.values())) == 6 + len(chunks)
    # time structure: chunks in order, inside prefill, inside kv receive, inside decode, inside router
    for a, b in zip(chunks, chunks[1:]):
        assert a.start_ns <= a.end_ns <= b.start_ns
    for c in chunks:  # when its forward was queued: within the chunk's span (on CPU it computed at once)
        assert 0 <= c.attributes["pdserve.chunk.launched_ms"] <= (c.end_ns - c.start_ns) / 1e6
        a = c.attributes  # of which the forward's launch; its CPU time within it; its layer-group exports within that
        assert 0 < a["pdserve.chunk.forward_ms"] <= a["pdserve.chunk.launched_ms"]
        assert 0 < a["pdserve.chunk.forward_cpu_ms"] <= a["pdserve.chunk.forward_ms"] * 1.05 + 0.5
        assert 0 <= a["pdserve.chunk.layer_export_ms"] <= a["pdserve.chunk.forward_ms"]
        assert a["pdserve.chunk.graph_tokens"] == 0  # CPU: no prefill graphs, every chunk launched eagerly
    assert prefill.start_ns <= lookup.start_ns <= lookup.end_ns <= chunks[0].start_ns
    assert chunks[-1].end_ns <= prefill.end_ns
    assert router.start_ns <= decode.start_ns <= recv.start_ns <= prefill.start_ns
    assert recv.end_ns <= decode.end_ns <= router.end_ns
    assert all(s.status_code != ERROR for ss in trace.values() for s in ss)


def test_span_attributes(traced):
    tid, _, _ = traced["ok"]
    stack, out = traced["stack"], traced["out"]
    trace = by_name(traced["spans"], tid)
    r = trace["router.generate"][0].attributes
    assert r["pdserve.request_id"] == out.request_id and r["pdserve.priority"] == "PRIORITY_UNSPECIFIED"
    assert r["pdserve.pcs.input_len"] == PROMPT_LEN and 1 <= r["pdserve.pcs.est_output_len"] <= MAX_TOKENS
    assert r["pdserve.pcs.num_special"] == 0 and r["pdserve.pcs.score"] > 0
    assert r["pdserve.priority.effective"] == "normal" and r["pdserve.pcs.estimate"] in (
        "learned",
        "length_only",
        "max_tokens",
    )
    assert r["pdserve.prefill"] == stack.prefill[0] and r["pdserve.decode"] == stack.decode[0]
    assert r["pdserve.admission"] == "admitted" and r["pdserve.attempt"] == 1
    assert r["pdserve.completion_tokens"] == MAX_TOKENS and r["pdserve.finish_reason"] == "length"
    assert r["rpc.grpc.status"] == "OK"
    # each hop's stages, in order, at times within their span (span_breakdown's rows); and its first token (which
    # the engine thread marks: a tiny model's may come before the servicer's last stage)
    for name, stages in (
        ("router.generate", ["planned", "dispatched"]),
        # (decode asks for the first token ahead of the pages by default: read off the stream before PrefillDone)
        (
            "decode.request",
            ["prefill_called", "admitted", "first_token_read", "prefill_done_read", "import_finished", "second_token"],
        ),
        ("prefill.request", ["read", "transfer_open", "admitted", "first_token_out"]),
    ):
        sp = trace[name][0]
        marks = [(e, t) for (e, _), t in zip(sp.events, sp.event_ns, strict=True) if e != "first_token"]
        assert [e for e, _ in marks] == stages and [e for e, _ in sp.events].count("first_token") == 1, name
        times = [t for _, t in marks]
        assert sp.start_ns <= times[0] and sorted(times) == times and times[-1] <= sp.end_ns, name

    d = trace["decode.request"][0]
    assert d.attributes["pdserve.request_id"] == out.request_id and d.attributes["pdserve.prefill"] == stack.prefill[0]
    assert d.attributes["pdserve.completion_tokens"] == MAX_TOKENS and d.attributes["pdserve.finish_reason"] == "length"
    assert next(a for e, a in d.events if e == "first_token")["pdserve.ttft_ms"] > 0
    recv = trace["decode.kv_receive"][0].attributes
    assert recv["pdserve.kv.pages"] == 8 and recv["pdserve.kv.dtype"] == "int8"
    assert recv["pdserve.first_token_id"] == out.token_ids[0]

    p = trace["prefill.request"][0].attributes
    assert p["pdserve.request_id"] == out.request_id and p["pdserve.prompt_tokens"] == PROMPT_LEN
    assert p["pdserve.finish_reason"] == "prefill_done" and p["pdserve.cached_tokens"] == 0
    lookup = trace["prefill.cache_lookup"][0].attributes  # the first time this prompt is seen
    assert lookup["pdserve.cache.enabled"] is True
    assert (lookup["pdserve.cache.pages_hit"], lookup["pdserve.cache.pages_miss"]) == (0, (PROMPT_LEN - 1) // PAGE)
    ship = trace["prefill.kv_ship"][0].attributes
    assert ship["pdserve.kv.pages"] == 8 and ship["pdserve.kv.bytes"] == recv["pdserve.kv.bytes"] > 0
    ready = [c.attributes["pdserve.chunk.ready_pages"] for c in trace["prefill.chunk"]]
    assert sum(ready) == 8


def test_async_stream_continues_client_trace(traced):
    tid, client_span, _ = traced["streamed"]
    trace = by_name(traced["spans"], tid)
    assert trace["router.generate"][0].parent_id == client_span
    assert trace["router.generate"][0].attributes["pdserve.completion_tokens"] == 3
    # same prompt again: whatever the prompt cache had by then (its writes are asynchronous), spans agree
    hit = trace["prefill.cache_lookup"][0].attributes["pdserve.cache.pages_hit"]
    assert hit + trace["prefill.cache_lookup"][0].attributes["pdserve.cache.pages_miss"] == (PROMPT_LEN - 1) // PAGE
    assert trace["prefill.request"][0].attributes["pdserve.cached_tokens"] == hit * PAGE
    assert trace["decode.kv_receive"][0].attributes["pdserve.cached_tokens"] == hit * PAGE
    ranges = sorted(
        (c.attributes["pdserve.chunk.start"], c.attributes["pdserve.chunk.end"]) for c in trace["prefill.chunk"]
    )
    assert ranges[0][0] == hit * PAGE and ranges[-1][1] == PROMPT_LEN
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert trace["prefill.kv_ship"][0].attributes["pdserve.kv.pages"] == -(-PROMPT_LEN // PAGE)  # cached ones too
    # the router's head start (the prefill had served a stream before): the lookup ran in Prefill.Start, beside the
    # dispatch to decode, and decode's stream took the request over
    (router,) = trace["router.generate"]
    (start,) = trace["prefill.start"]
    (prefill,) = trace["prefill.request"]
    (lookup,) = trace["prefill.cache_lookup"]
    assert start.parent_id == router.span_id
    assert all(c.parent_id == prefill.span_id for c in trace["prefill.chunk"])
    taken = [a for e, a in prefill.events if e == "head_start_taken"]
    if start.attributes["pdserve.head_start.started"]:
        assert lookup.parent_id == start.span_id
        assert len(taken) == 1 and taken[0]["pdserve.head_start.ms"] > 0
    else:  # the two hops raced on a loaded box and decode's stream reached the prefill first: it computed the request
        assert "came first" in start.attributes["pdserve.head_start.reason"]
        assert lookup.parent_id == prefill.span_id and taken == []


def test_error_recorded_with_status(traced):
    tid, client_span, _ = traced["bad"]
    trace = by_name(traced["spans"], tid)
    assert list(trace) == ["router.generate"]  # rejected before any instance was called
    (span,) = trace["router.generate"]
    assert span.parent_id == client_span and span.status_code == ERROR
    assert span.attributes["rpc.grpc.status"] == "INVALID_ARGUMENT" and "temperature" in span.status_message


def test_unsampled_client_trace_is_not_recorded(traced):
    """parentbased_always_on (the default sampler): a client's `sampled=0` decision holds on every hop."""
    assert by_name(traced["spans"], traced["unsampled"][0]) == {}


def test_metrics_scraped_and_parsed(traced):
    assert traced["counts"] == {"router": 4, "prefill": 3, "decode": 3}
    router, prefill, decode = (samples(traced["texts"][s]) for s in ("router", "prefill", "decode"))
    assert router[("pdserve_requests_total", (("status", "OK"),))] == 3
    assert router[("pdserve_requests_total", (("status", "INVALID_ARGUMENT"),))] == 1
    for svc in (router, decode):
        assert svc[("pdserve_request_ttft_seconds_count", ())] == 3
        assert svc[("pdserve_request_tpot_seconds_count", ())] == 3
        assert svc[("pdserve_request_e2e_seconds_count", ())] >= 3
        assert svc[("pdserve_requests_in_flight", ())] == 0
    assert prefill[("pdserve_request_ttft_seconds_count", ())] == 3
    stack = traced["stack"]
    assert router[("pdserve_outstanding_pcs", (("address", stack.prefill[0]), ("role", "prefill")))] == 0
    assert router[("pdserve_outstanding_pcs", (("address", stack.decode[0]), ("role", "decode")))] == 0
    assert router[("pdserve_requests_awaiting_first_token", ())] == 0 and router[("pdserve_queue_depth", ())] == 0
    for svc in (router, prefill, decode):  # the start-up heap frozen once ready; serving's collections timed
        assert all(("pdserve_gc_pause_seconds_count", (("generation", g),)) in svc for g in "012")
        assert svc[("pdserve_gc_frozen_objects", ())] > 10_000
    for svc in (prefill, decode):
        free, used = svc[("pdserve_kv_pages", (("state", "free"),))], svc[("pdserve_kv_pages", (("state", "used"),))]
        assert free + used == 256
        assert svc[("pdserve_queue_depth", ())] == 0
    cache = {labels[0][1]: v for (n, labels), v in prefill.items() if n == "pdserve_prompt_cache_total"}
    assert cache["lookups"] == 3 and cache["lookup_pages"] == 3 * ((PROMPT_LEN - 1) // PAGE)
    assert prefill[("pdserve_cache_hit_ratio", ())] == pytest.approx(cache["hits"] / cache["lookup_pages"])
    # every byte prefill shipped, decode received (both requests, sampled or not)
    shipped = prefill[("pdserve_kv_transfer_bytes_total", ())]
    assert shipped == decode[("pdserve_kv_transfer_bytes_total", ())] > 0


def test_exemplars_carry_trace_ids(traced):
    """Each bucket keeps the exemplar of its last sampled observation; unsampled requests leave none."""
    families = {f.name: f for f in parse_openmetrics(traced["router_om"])}
    sampled = {traced["ok"][0], traced["streamed"][0]}  # the completed, sampled requests
    ttft = {
        s.exemplar.labels["trace_id"]
        for s in families["pdserve_request_ttft_seconds"].samples
        if s.exemplar is not None
    }
    assert ttft and ttft <= sampled
    (rejected,) = [
        s
        for s in families["pdserve_requests"].samples
        if s.name == "pdserve_requests_total" and s.labels["status"] == "INVALID_ARGUMENT"
    ]
    assert rejected.exemplar.labels["trace_id"] == traced["bad"][0]


def test_dashboard_metrics_are_exported(traced):
    """Every metric the Grafana dashboard (deploy/) queries is one the services export."""
    import re
    from pathlib import Path

    dash = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/pdserve.json"
    used = set(re.findall(r"pdserve_[a-z0-9_]+", dash.read_text()))
    exported = {name for text in traced["texts"].values() for name, _ in samples(text)}
    assert used and used <= exported, used - exported
