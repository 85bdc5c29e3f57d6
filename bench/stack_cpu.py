"""CPU figures of the whole stack (router + prefill + decode as real processes, tiny model).

    python bench/stack_cpu.py [--model DIR] [--requests 20] [--prompt-len 128] [--max-tokens 64]

Prints TTFT (median, p90) and decode tokens/s at concurrency 1 and 8, for --kv-dtype int8 and auto.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    model = args.model or str(build_checkpoint(work / "model", arch="llama", seed=0))
    vocab = 512 if not args.model else 1000
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
