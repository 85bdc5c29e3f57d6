"""Tracing overhead on CPU TTFT: three identical stacks in the same run, one exporting every span over OTLP/gRPC to a
receiver in this process (pdserve.testing.otlp_sink), two with tracing off (their difference is the noise floor: an A/A
control); each prompt goes to all three in a rotating order.

    python bench/tracing_overhead.py [--model DIR] [--requests 40] [--prompt-lens 128,768] [--chunk-size 256]

Prints TTFT median / p90 per prompt length for off, off (control) and on, the differences of medians, and the
in-process cost of the spans of one hop (server span + child + context injection + ends), off vs on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from benchutil import ttft_ms

import pdserve
from pdserve.cli.launch import start_stack
from pdserve.models.checkpoints import build_checkpoint
from pdserve.telemetry.tracing import Tracing, end_span
from pdserve.testing.otlp_sink import OTLPSink

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_BSP_SCHEDULE_DELAY",
)


@contextmanager
def environ(**values: str):
    """os.environ with the OTEL_* variables replaced by `values` (the stack's processes inherit it)."""
    saved = {k: os.environ.get(k) for k in (*OTEL_VARS, *values)}
    for k in OTEL_VARS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def span_cost_us(tracing: Tracing, n: int) -> float:
    """Mean µs for the spans of one hop: server span from a traceparent, a child, injection, two ends."""
    md = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    t0 = time.perf_counter()
    for _ in range(n):
        span = tracing.server_span("bench.request", md, {"pdserve.request_id": "r"})
        child = tracing.child("bench.child", span, {"pdserve.kv.pages": 8})
        tracing.outgoing_metadata(child, md)
        end_span(child)
        end_span(span)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=40, help="per prompt length and mode")
    ap.add_argument("--prompt-lens", default="128,768")
    ap.add_argument("--chunk-size", type=int, default=256)
    args = ap.parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-trace-"))
    model = args.model or str(build_checkpoint(work / "model", arch="llama", seed=0))
    vocab = 512 if not args.model else 1000
    extra = ["--torch-threads", "1", "--num-pages", "1024"]
    with OTLPSink() as sink:
        stacks = {}
        try:
            for mode in ("off", "control"):
                with environ():
                    stacks[mode] = start_stack(
                        model, work / mode, kv_dtype="int8", chunk_size=args.chunk_size, extra=extra
                    )
            with environ(OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, OTEL_TRACES_SAMPLER="parentbased_always_on"):
                stacks["on"] = start_stack(model, work / "on", kv_dtype="int8", chunk_size=args.chunk_size, extra=extra)
            g = torch.Generator().manual_seed(0)
            res: dict[tuple[int, str], list[float]] = {}
            clients = {mode: pdserve.Client(s.router, timeout=120) for mode, s in stacks.items()}
            modes = list(clients)
            for c in clients.values():
                ttft_ms(c, list(range(5, 69)))  # warm-up
            for n in lens:
                for i in range(args.requests):
                    ids = torch.randint(5, vocab, (n,), generator=g).tolist()
                    for k in range(len(modes)):  # rotate the order: no position or drift bias
                        mode = modes[(i + k) % len(modes)]
                        res.setdefault((n, mode), []).append(ttft_ms(clients[mode], ids))
            for c in clients.values():
                c.close()
        finally:
            for s in stacks.values():
                s.stop()  # the traced one flushes its remaining spans into the sink
        n_spans = len(sink.spans())

    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]
    print(
        f"{'prompt':>6s} {'chunks':>6s} {'off p50':>8s} {'ctrl p50':>8s} {'on p50':>8s} {'ctrl-off':>8s} "
        f"{'on-off':>8s} {'on-off %':>8s} {'off p90':>8s} {'on p90':>8s}   (ms)"
    )
    for n in lens:
        m = {mode: statistics.median(res[(n, mode)]) for mode in modes}
        print(
            f"{n:6d} {-(-n // args.chunk_size):6d} {m['off']:8.2f} {m['control']:8.2f} {m['on']:8.2f} "
            f"{m['control'] - m['off']:8.2f} {m['on'] - m['off']:8.2f} {(m['on'] / m['off'] - 1) * 100:8.1f} "
            f"{p90(res[(n, 'off')]):8.2f} {p90(res[(n, 'on')]):8.2f}"
        )
    print(f"spans received by the OTLP sink: {n_spans}")

    # 1000 hops = 2000 spans fit the batch queue (2048); exported at shutdown, after the timing
    with OTLPSink() as sink, environ(OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, OTEL_BSP_SCHEDULE_DELAY="600000"):
        t_on = Tracing("bench")
        cost_on = statistics.median(span_cost_us(t_on, 200) for _ in range(5))
        t_on.shutdown()
    with environ():
        cost_off = statistics.median(span_cost_us(Tracing("bench"), 200) for _ in range(5))
    print(
        f"spans of one hop (server span + child + inject + 2 ends, export excluded): off {cost_off:.2f} µs, "
        f"on {cost_on:.1f} µs"
    )


if __name__ == "__main__":
    main()
