"""pdserve.telemetry.metrics: /metrics over HTTP on a free port, parsed with prometheus_client's parsers
(text format and
OpenMetrics with exemplars); callback gauges read at scrape time; each service owns its registry."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from pdserve.telemetry.metrics import ServiceMetrics

TID = "4bf92f3577b34da6a3ce929d0e0e4736"


def get(port: int, accept: str | None = None) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if accept:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


@pytest.fixture
def metrics():
    m = ServiceMetrics("decode")
    yield m
    m.stop()


def test_scrape_and_parse(metrics):
    pages = {"used": 3}
    metrics.gauge("kv_pages", "pages", lambda: {("used",): pages["used"], ("free",): 10 - pages["used"]}, ["state"])
    metrics.gauge("queue_depth", "queue", lambda: 2)
    metrics.observe("OK", 0.5, ttft_s=0.05, tpot_s=0.01, trace_id=TID)
    metrics.observe("CANCELLED", 0.2)
    port = metrics.serve("127.0.0.1", 0)
    assert port and port > 0
    pages["used"] = 4  # read at scrape time
    fams = {f.name: f for f in text_string_to_metric_families(get(port))}
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert val[("pdserve_requests_total", (("status", "OK"),))] == 1
    assert val[("pdserve_requests_total", (("status", "CANCELLED"),))] == 1
    assert val[("pdserve_request_e2e_seconds_count", ())] == 2 and val[("pdserve_request_e2e_seconds_sum", ())] == 0.7
    assert val[("pdserve_request_ttft_seconds_count", ())] == 1
    assert val[("pdserve_request_ttft_seconds_bucket", (("le", "0.05"),))] == 1
    assert val[("pdserve_request_ttft_seconds_bucket", (("le", "0.025"),))] == 0
    assert val[("pdserve_request_tpot_seconds_count", ())] == 1
    assert val[("pdserve_kv_pages", (("state", "used"),))] == 4 and val[("pdserve_kv_pages", (("state", "free"),))] == 6
    assert val[("pdserve_queue_depth", ())] == 2
    assert fams["pdserve_kv_pages"].type == "gauge" and fams["pdserve_request_ttft_seconds"].type == "histogram"


def test_openmetrics_exemplars(metrics):
    metrics.observe("OK", 0.5, ttft_s=0.05, tpot_s=0.01, trace_id=TID)
    port = metrics.serve("127.0.0.1", 0)
    text = get(port, "application/openmetrics-text; version=1.0.0")
    fams = {f.name: f for f in parse_openmetrics(text)}
    for name in (
        "pdserve_request_ttft_seconds",
        "pdserve_request_tpot_seconds",
        "pdserve_request_e2e_seconds",
        "pdserve_requests",
    ):
        ex = [s.exemplar for s in fams[name].samples if s.exemplar is not None]
        assert [e.labels for e in ex] == [{"trace_id": TID}], name


def test_broken_gauge_does_not_break_scrape(metrics):
    metrics.gauge("broken", "raises", lambda: 1 / 0)
    port = metrics.serve("127.0.0.1", 0)
    names = {f.name for f in text_string_to_metric_families(get(port))}
    assert "pdserve_requests_in_flight" in names


def test_off_and_separate_registries():
    m = ServiceMetrics("router")
    assert m.serve("127.0.0.1", -1) is None
    other = ServiceMetrics("router")  # a second instance in one process: no duplicate-registration error
    m.observe("OK", 1.0)
    assert other.registry.get_sample_value("pdserve_requests_total", {"status": "OK"}) is None
    assert m.registry.get_sample_value("pdserve_requests_total", {"status": "OK"}) == 1


def test_watch_prompt_cache(metrics):
    """The prompt cache's own counters and page hit ratio (a real in-process PromptCache, empty: all misses)."""
    from pdserve.cache.keys import CacheNamespace
    from pdserve.cache.prompt_cache import PromptCache
    from pdserve.cache.store import MemoryStore
    from pdserve.kv.codec import KVLayoutSpec
    from pdserve.telemetry.metrics import watch_prompt_cache

    cache = PromptCache(MemoryStore(1 << 20))
    try:
        watch_prompt_cache(metrics, cache)
        ns = CacheNamespace(
            "fp", KVLayoutSpec(dtype="int8", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16, group_size=16)
        )
        assert cache.lookup(ns, list(range(5, 22)), max_pages=4).num_pages == 0
        val = metrics.registry.get_sample_value
        assert val("pdserve_prompt_cache_total", {"event": "lookups"}) == 1
        assert val("pdserve_prompt_cache_total", {"event": "lookup_pages"}) == 4
        assert val("pdserve_prompt_cache_total", {"event": "misses"}) == 4
        assert val("pdserve_prompt_cache_total", {"event": "hits"}) == 0
        assert val("pdserve_cache_hit_ratio", {}) == 0.0
        scope = {"scope": "", "event": "lookup_pages"}  # an unscoped namespace (no router in front)
        assert val("pdserve_prompt_cache_scope_pages_total", scope) == 4
        assert val("pdserve_prompt_cache_scope_pages_total", scope | {"event": "hits"}) == 0
    finally:
        cache.close()


def test_watch_engine_reads_the_loop_at_scrape_time(metrics):
    from types import SimpleNamespace

    from pdserve.telemetry.metrics import watch_engine

    steps = {"decode_graph": 0, "prefill_graph": 0, "eager": 0}
    runner = SimpleNamespace(tp_size=1, steps_launched=steps)
    engine = SimpleNamespace(scheduler=SimpleNamespace(waiting=[1, 2], running=[3]), runner=runner)
    loop = SimpleNamespace(allocator=SimpleNamespace(num_used=3, num_pages=8), engine=engine, anytime_submitted=0,
                           ran_during_gpu_wait=0, ran_while_idle=0, share_mark=None, share_yield=None)  # fmt: skip
    watch_engine(metrics, loop)
    port = metrics.serve("127.0.0.1", 0)
    assert port
    loop.anytime_submitted, loop.ran_during_gpu_wait, loop.ran_while_idle = 5, 4, 1
    steps["prefill_graph"], steps["decode_graph"] = 7, 30
    fams = {f.name: f for f in text_string_to_metric_families(get(port))}
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert val[("pdserve_kv_pages", (("state", "free"),))] == 5 and val[("pdserve_queue_depth", ())] == 2
    assert val[("pdserve_engine_host_commands_total", (("event", "submitted"),))] == 5
    assert val[("pdserve_engine_host_commands_total", (("event", "ran_during_gpu_wait"),))] == 4
    assert val[("pdserve_engine_host_commands_total", (("event", "ran_while_idle"),))] == 1
    assert fams["pdserve_engine_host_commands"].type == "counter"
    assert val[("pdserve_engine_steps_total", (("launch", "prefill_graph"),))] == 7
    assert val[("pdserve_engine_steps_total", (("launch", "decode_graph"),))] == 30
    assert val[("pdserve_engine_steps_total", (("launch", "eager"),))] == 0
    assert "pdserve_decode_yield_holds" not in fams  # no GPU shared: no share counters


def test_watch_engine_counts_a_shared_gpus_marks_and_holds(metrics):
    from types import SimpleNamespace

    from pdserve.telemetry.metrics import watch_engine

    engine = SimpleNamespace(
        scheduler=SimpleNamespace(waiting=[], running=[]), runner=SimpleNamespace(tp_size=1, steps_launched={})
    )
    held = SimpleNamespace(waits=0, waited_ms=0.0)
    loop = SimpleNamespace(allocator=SimpleNamespace(num_used=0, num_pages=8), engine=engine, anytime_submitted=0,
                           ran_during_gpu_wait=0, ran_while_idle=0, share_mark=object(), share_marks=0,
                           share_yield=held)  # fmt: skip
    watch_engine(metrics, loop)
    port = metrics.serve("127.0.0.1", 0)
    loop.share_marks, held.waits, held.waited_ms = 7, 3, 1500.0
    val = {s.name: s.value for f in text_string_to_metric_families(get(port)) for s in f.samples}
    assert val["pdserve_gpu_share_marked_steps_total"] == 7 and val["pdserve_decode_yield_holds_total"] == 3
    assert val["pdserve_decode_yield_held_seconds_total"] == 1.5


def test_watch_kv_shipper(metrics, monkeypatch):
    """Two real decode shippers: up while both serve, their dropped batches and restarts summed, down once one is
    killed."""
    import os
    import signal

    from pdserve.kv.shipper import link as link_module
    from pdserve.kv.shipper.group import ShipperGroup
    from pdserve.telemetry.metrics import watch_kv_shipper

    group = ShipperGroup.of("decode", 2, 2 << 20, pin=False).start()
    try:
        watch_kv_shipper(metrics, group)
        val = metrics.registry.get_sample_value
        assert val("pdserve_kv_shipper_up", {}) == 1.0
        assert val("pdserve_kv_shipper_total", {"event": "restarts"}) == 0
        group.links[0].dropped, group.links[1].dropped = 2, 3
        assert val("pdserve_kv_shipper_total", {"event": "dropped"}) == 5
        dead = group.links[1]
        assert dead.pid is not None
        os.kill(dead.pid, signal.SIGKILL)
        dead._proc.wait()  # type: ignore[union-attr]
        assert val("pdserve_kv_shipper_up", {}) == 0.0
        monkeypatch.setattr(link_module, "RESTART_AFTER_S", 0.0)
        assert group.ready()
        assert val("pdserve_kv_shipper_up", {}) == 1.0
        assert val("pdserve_kv_shipper_total", {"event": "restarts"}) == 1
    finally:
        group.close()
