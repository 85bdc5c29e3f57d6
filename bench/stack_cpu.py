"""CPU figures of the whole stack (router + prefill + decode as real processes, tiny model).

    python bench/stack_cpu.py [--model DIR] [--requests 20] [--prompt-len 128] [--max-tokens 64]
    python bench/stack_cpu.py --breakdown [--prompt-len 1024] [--transport grpc|cuda-ipc]
    python bench/stack_cpu.py --kv-rate [--prompt-len 2048] [--requests 5]

Prints TTFT (median, p90) and decode tokens/s at concurrency 1 and 8, for --kv-dtype int8 and auto.
`--breakdown`: one int8 stack exporting its spans to an in-process OTLP receiver; the served TTFT at concurrency 1
beside the in-process engine's for prompts of the same length, and where the served time goes, span by span
(`pdserve.testing.span_breakdown`). On CPU the fixed cost of the hops is visible next to a small model's compute.
`--kv-rate`: the `grpc` KV transport's GB/s inside the services (prefill's Stats: page bytes / transfer seconds)
beside a raw Python gRPC stream of 8 MiB messages on this host, with a llama whose KV is wide for its compute
(8 layers x 8 KV heads x 128).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import pdserve
from pdserve.cli.launch import start_stack
from pdserve.models.checkpoints import build_checkpoint


def one(client: pdserve.Client, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft = None
    n = 0
    for ch in client.stream(token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if ttft is None and ch.token_ids:
            ttft = time.perf_counter() - t0
        n += len(ch.token_ids)
    return ttft, time.perf_counter() - t0, n


def run(router: str, requests: int, concurrency: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    with pdserve.Client(router, timeout=300) as c:
        one(c, prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as ex:
            res = list(ex.map(lambda ids: one(c, ids, max_tokens), prompts))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] * 1e3 for r in res)
    itl = [(r[1] - r[0]) / max(1, r[2] - 1) * 1e3 for r in res]
    return dict(
        ttft_p50=statistics.median(ttfts),
        ttft_p90=ttfts[int(0.9 * (len(ttfts) - 1))],
        itl_ms=statistics.median(itl),
        tok_s=sum(r[2] for r in res) / wall,
    )


def breakdown_run(model: str, work: Path, requests: int, prompt_len: int, vocab: int, transport: str) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.testing.otlp_sink import OTLPSink
    from pdserve.testing.span_breakdown import breakdown, format_breakdown

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(requests + 1)]
    torch.set_num_threads(1)  # as each service below (--torch-threads 1)
    engine = LLMEngine(EngineConfig(model_dir=model, device="cpu", kv_dtype="int8", chunk_size=2048))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    engine_ms = []
    for ids in prompts:  # the first one warms up
        t0 = time.perf_counter()
        engine.generate([ids], greedy)
        engine_ms.append((time.perf_counter() - t0) * 1e3)
    del engine
    with OTLPSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        extra = ["--torch-threads", "1", "--kv-transport", transport]
        stack = start_stack(model, work / "stack-breakdown", kv_dtype="int8", extra=extra, env=env)
        try:
            with pdserve.Client(stack.router, timeout=300) as c:
                one(c, prompts[0], 1)  # warm-up
                time.sleep(1.0)
                sink.clear()
                served_ms = [one(c, ids, 1)[0] * 1e3 for ids in prompts[1:]]
            time.sleep(1.0)  # the services' span processors export every 200 ms
            table = breakdown(sink.spans())
        finally:
            stack.stop()
    e, s = statistics.median(engine_ms[1:]), statistics.median(served_ms)
    print(f"prompt {prompt_len} tokens, {requests} requests, transport {transport}")
    print(f"TTFT median: in-process engine {e:.1f} ms, served {s:.1f} ms ({s / e:.2f}x, +{s - e:.1f} ms)")
    print("where the served TTFT goes (median; ms from the router span's start):")
    print(format_breakdown(table))


def kv_rate_run(work: Path, requests: int, prompt_len: int, rounds: int = 3) -> None:
    from gpu_serving import raw_grpc

    from pdserve.server.grpc_util import channel
    from pdserve.server.security import ChannelSecurity
    from pdserve.v1 import internal_pb2, internal_pb2_grpc

    wide = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8)
    wide.update(num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)  # 16 KB of int8 KV per token
    model = build_checkpoint(work / "kv-wide", arch="llama", seed=1, **wide)
    g = torch.Generator().manual_seed(2)
    stack = start_stack(model, work / "stack-kv", extra=["--torch-threads", "1", "--kv-transport", "grpc"])
    security = ChannelSecurity(token=stack.internal_token)

    def kv() -> tuple[int, float]:
        with channel(stack.prefill[0], security) as ch:
            s = internal_pb2_grpc.PrefillStub(ch).Stats(internal_pb2.StatsRequest(), timeout=10)
        t = {t.transport: t for t in s.kv_transports}["grpc"]
        return t.bytes, t.transfer_seconds

    def fresh() -> list[int]:
        return torch.randint(5, 512, (prompt_len,), generator=g).tolist()

    rows = []  # per round: (KV GB/s in the services, raw gRPC GB/s), measured back to back (a noisy host drifts)
    try:
        with pdserve.Client(stack.router, timeout=300) as c:
            one(c, fresh(), 1)  # warm-up
            for _ in range(rounds):
                raw = raw_grpc(work, msg_mb=8, total_mb=512)["raw_grpc_gbps"]
                b0, s0 = kv()
                for _ in range(requests):
                    one(c, fresh(), 1)
                b1, s1 = kv()
                rows.append(((b1 - b0) / (s1 - s0) / 1e9, raw))
                mb = (b1 - b0) / requests / 1e6
                print(f"round: KV {rows[-1][0]:.3f} GB/s ({mb:.1f} MB per request), raw {raw:.3f} GB/s", flush=True)
    finally:
        stack.stop()
    ratio = statistics.median(k / r for k, r in rows)
    kv_med, raw_med = statistics.median(k for k, _ in rows), statistics.median(r for _, r in rows)
    print(
        f"grpc KV transport {kv_med:.3f} GB/s, raw gRPC stream (8 MiB messages) {raw_med:.3f} GB/s, "
        f"median per-round ratio {ratio:.2f} ({prompt_len}-token prompts, {rounds} rounds of {requests})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--breakdown", action="store_true", help="served vs in-process TTFT and the span breakdown")
    ap.add_argument("--transport", default="grpc", help="--breakdown: the stack's --kv-transport")
    ap.add_argument("--kv-rate", action="store_true", help="grpc KV GB/s in the services vs a raw gRPC stream")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    if args.kv_rate:
        kv_rate_run(work, args.requests, args.prompt_len)
        return
    shapes = {"max_position_embeddings": 4096} if args.prompt_len >= 1024 else {}
    model = args.model or str(build_checkpoint(work / "model", arch="llama", seed=0, **shapes))
    vocab = 512 if not args.model else 1000
    if args.breakdown:
        breakdown_run(model, work, args.requests, args.prompt_len, vocab, args.transport)
        return
    print(f"{'kv':6s} {'conc':>4s} {'ttft p50 ms':>12s} {'ttft p90 ms':>12s} {'ITL ms':>8s} {'tokens/s':>9s}")
    for kv in ("int8", "auto"):
        stack = start_stack(model, work / f"stack-{kv}", kv_dtype=kv, extra=["--torch-threads", "1"])
        try:
            for conc in (1, 8):
                r = run(stack.router, args.requests, conc, args.prompt_len, args.max_tokens, vocab)
                print(
                    f"{kv:6s} {conc:4d} {r['ttft_p50']:12.1f} {r['ttft_p90']:12.1f} {r['itl_ms']:8.2f} "
                    f"{r['tok_s']:9.1f}",
                    flush=True,
                )
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
