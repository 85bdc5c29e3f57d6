"""Prometheus metrics of one service, served at http://HOST:PORT/metrics (text format, or OpenMetrics with
exemplars carrying trace ids when the scraper asks for `application/openmetrics-text`).

Every service: `pdserve_requests_total{status}`, `pdserve_requests_in_flight`, histograms
`pdserve_request_ttft_seconds`, `pdserve_request_tpot_seconds`, `pdserve_request_e2e_seconds`, and the gauges its
server registers at start (`gauge(...)`: queue depth, KV pages, cache hit ratio, outstanding PCS), read at
scrape time. Each service owns its registry (no process-global state).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("pdserve.telemetry.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

GaugeFn = Callable[[], float | Mapping[tuple[str, ...], float] | None]


class _Callback(Collector):
    """A gauge (or counter) whose value(s) `fn` returns at scrape time: a number, or {label values: number}; None:
    no sample now."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str], fn: GaugeFn, family=GaugeMetricFamily):
        self.name, self.doc, self.labelnames, self.fn, self.family = name, doc, list(labelnames), fn, family

    def describe(self):
        return [self.family(self.name, self.doc, labels=self.labelnames)]

    def collect(self):
        fam = self.family(self.name, self.doc, labels=self.labelnames)
        try:
            values = self.fn()
        except Exception:
            log.exception("gauge %s failed", self.name)
            return [fam]
        if values is None:
            return [fam]
        if self.labelnames:
            for key, v in values.items():
                fam.add_metric(list(key), float(v))
        else:
            fam.add_metric([], float(values))
        return [fam]


class ServiceMetrics:
    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by final gRPC status", ["status"], registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served", registry=r)
        latency = functools.partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = latency("pdserve_request_ttft_seconds", "Time to first token (prefill: time to the prefill result)")
        self.tpot = Histogram(
            "pdserve_request_tpot_seconds", "Time per output token after the first", buckets=TPOT_BUCKETS, registry=r
        )
        self.e2e = latency("pdserve_request_e2e_seconds", "Request latency, start to end of the RPC")
        self.awaiting_first = Gauge(
            "pdserve_requests_awaiting_first_token",
            "Requests without their first token yet (queued or prefilling)",
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV page bytes shipped (prefill) or received (decode)", registry=r
        )
        self.gc_pause = Histogram(
            "pdserve_gc_pause_seconds",
            "Garbage-collection pauses of this process (every thread stopped), by generation",
            ["generation"],
            buckets=GC_BUCKETS,
            registry=r,
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def gauge(self, name: str, doc: str, fn: GaugeFn, labelnames: Sequence[str] = ()) -> None:
        """Register a gauge read from `fn()` at scrape time (name without the `pdserve_` prefix)."""
        self.registry.register(_Callback(f"pdserve_{name}", doc, labelnames, fn))

    def counter(self, name: str, doc: str, fn: GaugeFn, labelnames: Sequence[str] = ()) -> None:
        """Register a counter kept elsewhere, read from `fn()` at scrape time (exposed as `pdserve_<name>_total`)."""
        self.registry.register(_Callback(f"pdserve_{name}", doc, labelnames, fn, CounterMetricFamily))

    def observe(
        self,
        status: str,
        e2e_s: float,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        trace_id: str | None = None,
    ) -> None:
        """One finished request; `trace_id` becomes the exemplar of its samples."""
        ex = {"trace_id": trace_id} if trace_id else None
        self.requests.labels(status).inc(exemplar=ex)
        self.e2e.observe(e2e_s, exemplar=ex)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, exemplar=ex)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, exemplar=ex)

    # ---- HTTP endpoint ---------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int | None:
        """Serve /metrics on host:port (0 = any free port, negative = off). Returns the bound port."""
        if port < 0:
            return None
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_port
        log.info("%s metrics on http://%s:%d/metrics", self.service, host, bound)
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def watch_engine(metrics: ServiceMetrics, loop) -> None:
    """Gauges of a prefill/decode engine (`pdserve.engine.loop.EngineLoop`): KV pool pages used/free, queue depth
    (requests waiting to be scheduled), running requests; on a shared GPU, the prefill's marked steps and the decode's
    holds. Read without locks: possibly one step stale."""

    def pages() -> dict[tuple[str, ...], float]:
        used, total = loop.allocator.num_used, loop.allocator.num_pages
        return {("used",): used, ("free",): total - used}

    metrics.gauge("kv_pages", "KV pool pages by state", pages, ["state"])
    metrics.gauge("queue_depth", "Requests waiting in the engine queue", lambda: len(loop.engine.scheduler.waiting))
    metrics.gauge(
        "running_requests", "Requests in the running (decode) batch", lambda: len(loop.engine.scheduler.running)
    )
    metrics.counter(
        "engine_host_commands",
        "Host-only engine commands (an import's page reservation, its first token, its end): submitted, and "
        "ran_during_gpu_wait: run while a step computed on the GPU instead of after it; ran_while_idle: run at once "
        "on the caller's thread, the engine thread waiting for work",
        lambda: {
            ("submitted",): loop.anytime_submitted,
            ("ran_during_gpu_wait",): loop.ran_during_gpu_wait,
            ("ran_while_idle",): loop.ran_while_idle,
        },
        ["event"],
    )
    metrics.counter(
        "engine_steps",
        "Engine steps by how their forward was launched: decode_graph (a captured decode batch), prefill_graph "
        "(the piecewise prefill graphs of a token bucket), eager (kernel by kernel)",
        lambda: {(k,): v for k, v in loop.engine.runner.steps_launched.items()},
        ["launch"],
    )
    metrics.gauge(
        "tensor_parallel_size",
        "Ranks (processes) of this instance's tensor-parallel group (1: no tensor parallelism)",
        lambda: loop.engine.runner.tp_size,
    )
    # a GPU shared with the other role's engine (pdserve.engine.gpu_share): the prefill's marks, the decode's holds
    if loop.share_mark is not None:
        metrics.counter(
            "gpu_share_marked_steps",
            "Prefill steps marked for the decode engine sharing this GPU",
            lambda: loop.share_marks,
        )
    if loop.share_yield is not None:
        y = loop.share_yield
        metrics.counter(
            "decode_yield_holds",
            "Times the decode held a step back while the prefill on its GPU computed",
            lambda: y.waits,
        )
        metrics.counter(
            "decode_yield_held_seconds",
            "Time the decode held its steps back for that prefill",
            lambda: y.waited_ms / 1e3,
        )


def watch_pools(metrics: ServiceMetrics, *pools) -> None:
    """Router gauge: outstanding PCS per instance of each pool (objects with `.role` and `.snapshot()` of
    instances with `.address` and `.outstanding_pcs`)."""

    def outstanding() -> dict[tuple[str, ...], float]:
        return {(p.role, i.address): i.outstanding_pcs for p in pools for i in p.snapshot()}

    metrics.gauge(
        "outstanding_pcs", "Outstanding prompt complexity score per instance", outstanding, ["role", "address"]
    )


PROMPT_CACHE_EVENTS = (
    "lookups",
    "lookup_pages",
    "hits",
    "misses",
    "local_hits",
    "mac_failures",
    "corrupt",
    "errors",
    "skipped",
    "writes",
    "write_bytes",
    "write_drops",
    "write_skips",
    "too_large",
    "rekeyed",
)


def watch_prompt_cache(metrics: ServiceMetrics, cache) -> None:
    """Prefill's prompt cache (`pdserve.cache.prompt_cache.PromptCache`): `pdserve_cache_hit_ratio` (pages found /
    full pages asked for), its counters as `pdserve_prompt_cache_total{event}` (pages unless named otherwise),
    per scope `pdserve_prompt_cache_scope_pages_total{scope, event=lookup_pages|hits}`, and with a fetch helper
    process `pdserve_prompt_cache_fetch_helper_total{event}` and `pdserve_prompt_cache_fetch_arena_free_bytes`."""
    metrics.gauge("cache_hit_ratio", "Prompt cache: pages found / full prompt pages looked up", cache.hit_ratio)

    def events() -> dict[tuple[str, ...], float]:
        snap = cache.stats.snapshot()
        return {(k,): snap[k] for k in PROMPT_CACHE_EVENTS if k in snap}

    metrics.counter("prompt_cache", "Prompt cache events (pages; write_bytes in bytes)", events, ["event"])

    def scopes() -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for scope, (asked, found) in cache.stats.scopes().items():
            out[(scope, "lookup_pages")], out[(scope, "hits")] = asked, found
        return out

    metrics.counter(
        "prompt_cache_scope_pages",
        "Prompt cache pages asked for / found per scope (the router's tenant or shared namespace)",
        scopes,
        ["scope", "event"],
    )

    def helper() -> dict[tuple[str, ...], float]:  # read at scrape time: the helper starts with the servicer
        proc = cache.fetch_process
        return {} if proc is None else {(k,): v for k, v in proc.events().items()}

    def arena_free() -> float | None:
        proc = cache.fetch_process
        return None if proc is None else proc.arena.free_bytes

    metrics.counter(
        "prompt_cache_fetch_helper",
        "Prefix fetch helper process: restarts, and fetches run in this process instead (fallback_arena_full, "
        "fallback_helper_down)",
        helper,
        ["event"],
    )
    metrics.gauge("prompt_cache_fetch_arena_free_bytes", "Free bytes of the fetch helper's shared arena", arena_free)


def watch_kv_shipper(metrics: ServiceMetrics, link) -> None:
    """The grpc-shm shipper processes beside this engine (`pdserve.kv.shipper.group.ShipperGroup`, or one
    `ShipperLink`): `pdserve_kv_shipper_up` (1 while every one serves: a transfer needs all of them) and
    `pdserve_kv_shipper_total{event=restarts|dropped}`, summed over them (dropped: decode, batches that landed for no
    open transfer and were given back)."""
    metrics.gauge("kv_shipper_up", "KV shipper processes all serving (1) or not (0)", lambda: float(link.alive))
    metrics.counter(
        "kv_shipper",
        "KV shipper process events, all shippers: restarts; dropped (batches landed for no open transfer, given back)",
        lambda: {(k,): float(v) for k, v in link.events().items()},
        ["event"],
    )
