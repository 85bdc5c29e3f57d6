"""Where a served request's first token goes, hop by hop, with the decode instance idle and with decoding streams
beside it: `pdserve up`'s stack (router, prefill, decode) of a tiny random Llama on this host's CPU (or `--model`),
every service exporting its spans to an in-process OTLP sink; probe requests of `--prompt` tokens, one at a time,
first alone and then while `pdserve bench` (its own process) keeps `--streams` long generations running.

    python bench/diag/hops_under_load.py [--prompt 256] [--streams 3] [--probes 15] [--model DIR --gpus 0 --mps auto]

Prints each phase's TTFT median and `pdserve.testing.span_breakdown`'s table of the probes' spans (median start
offset from the router's span, median duration) with the stage events the hops mark (router planned / dispatched,
decode prefill_called / admitted, prefill read / transfer_open / admitted / first_token_out). Figures:
docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchutil import model_or_tiny, token_times_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model directory (default: a tiny random Llama, written here)")
    ap.add_argument("--prompt", type=int, default=256, help="probe prompt tokens (one chunk)")
    ap.add_argument("--streams", type=int, default=3, help="decoding streams beside the probes in the second phase")
    ap.add_argument("--probes", type=int, default=15)
    ap.add_argument("--gpus", default="", help="comma-separated GPU indices for the engines (`pdserve up --gpus`)")
    ap.add_argument("--mps", default="auto", choices=("off", "auto", "on"), help="`pdserve up --mps` (its default)")
    ap.add_argument(
        "--gap-s",
        type=float,
        default=0.0,
        help="pause between probes (0: back to back; a gap lets the last probe's prompt-cache write-back finish first)",
    )
    ap.add_argument("--output", type=int, default=300, help="tokens each decoding stream generates")
    ap.add_argument("--transport", default="auto", help="the KV transport (`pdserve up --kv-transport`)")
    ap.add_argument(
        "--up-args", default="", help="more `pdserve up` flags, one string (e.g. '--gil-switch-interval-us 200')"
    )
    ap.add_argument(
        "--each",
        action="store_true",
        help="also every span of each phase's last probe (a prompt of "
        "several chunks has a span per chunk, which the medians merge)",
    )
    args = ap.parse_args()
    import pdserve
    from pdserve.cli.launch import start_stack
    from pdserve.testing.otlp_sink import OTLPSink
    from pdserve.testing.span_breakdown import breakdown, format_breakdown

    tmp = Path(tempfile.mkdtemp(prefix="hops-"))
    model, vocab = model_or_tiny(args.model, tmp)
    vocab = min(8000, vocab - 1)
    sink = OTLPSink().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    gpus = [int(g) for g in args.gpus.split(",") if g]
    extra = ([] if gpus else ["--torch-threads", "1"]) + ["--kv-transport", args.transport] + shlex.split(args.up_args)
    stack = start_stack(model, tmp / "stack", kv_dtype="int8", extra=extra, env=env, gpus=gpus, mps=args.mps)
    rng = random.Random(0)

    def probe(n: int) -> list[list[float]]:
        """Each probe's first and second token times, ms."""
        times = []
        with pdserve.Client(stack.router, timeout=120) as c:
            for _ in range(n):
                time.sleep(args.gap_s)
                times.append(token_times_ms(c, [rng.randrange(5, vocab) for _ in range(args.prompt)])[0][:2])
        return times

    def report(label: str, times: list[list[float]]) -> None:
        time.sleep(2.0)  # the services' span processors export every 200 ms
        spans = sink.spans()
        probes = {s.trace_id for s in spans if s.name == "prefill.chunk"
                  and s.attributes.get("pdserve.chunk.end") == args.prompt}  # fmt: skip
        ttft, t2t = statistics.median(t[0] for t in times), statistics.median(t[-1] for t in times)
        print(f"{label}: TTFT median {ttft:.1f} ms, second token {t2t:.1f} ms, over {len(times)}")
        print(format_breakdown(breakdown([s for s in spans if s.trace_id in probes])))
        if args.each and probes:
            last = max((s for s in spans if s.trace_id in probes and s.name == "router.generate"),
                       key=lambda s: s.start_ns)  # fmt: skip
            for s in sorted((s for s in spans if s.trace_id == last.trace_id), key=lambda s: s.start_ns):
                first = next((a["pdserve.ttft_ms"] for n, a in s.events if n == "first_token"), None)
                print(
                    f"    {s.service}/{s.name:<28} {(s.start_ns - last.start_ns) / 1e6:9.2f} ms  "
                    f"{(s.end_ns - s.start_ns) / 1e6:9.2f} ms" + (f"  first token at +{first:.2f}" if first else "")
                )

    load = None
    try:
        probe(3)  # warm-up
        time.sleep(1.0)
        sink.clear()
        report("decode idle", probe(args.probes))
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--target", stack.router, "--json", str(tmp / "load.json"),
               "--no-progress", "--concurrency", str(args.streams), "--num-requests", "1000", "--input-dist",
               "fixed:64", "--output-dist", f"fixed:{args.output}", "--vocab-size", str(vocab),
               "--slo-preset", "cpu"]  # fmt: skip
        load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(4.0)
        sink.clear()
        report(f"beside {args.streams} decoding streams", probe(args.probes))
    finally:
        if load is not None:
            load.kill()
        stack.stop()
        sink.stop()
    for line in stack.log_text().splitlines():  # EngineLoop: first tokens during GPU waits; steps held for prefill
        if any(s in line for s in ("host-only commands", "held steps back", "sharing the GPU")):
            print(line.split(" INFO ", 1)[-1])


if __name__ == "__main__":
    main()
