"""int8 KV quantization: round-trip error on a trained model's real K/V, and CPU throughput vs memcpy.

    python bench/kv_quant.py [--model DIR] [--tokens 512] [--mb 64] [--iters 5]

Without --model it trains the tiny llama (pdserve.models.train_tiny, ~45 s on 2 CPU cores) into a temp dir.
K/V are captured from the HF forward's cache on held-out corpus text (K after RoPE, as the engine stores it).
Throughput: quantize / dequantize of a --mb MiB float32 K/V tensor (the real K/V tiled), in GB/s of dense
input (quantize) or dense output (dequantize), beside torch.clone of the same bytes in the same run.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from pdserve.kv.quant import dequantize, quantize
from pdserve.models.train_tiny import capture_kv, split_corpus, train_tiny_checkpoint


def error_row(x: torch.Tensor, group_size: int, asymmetric: bool) -> tuple[float, float, float]:
    q, s, z = quantize(x, group_size, asymmetric)
    err = (dequantize(q, s, z, group_size) - x).abs()
    return err.mean().item(), err.max().item(), (err.mean() / x.abs().mean()).item()


def bytes_per_token_head(head_dim: int, group_size: int, asymmetric: bool) -> int:
    return head_dim + (4 if asymmetric else 2) * (head_dim // group_size)


def best_seconds(fn, iters: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="trained checkpoint dir (default: train one, ~45 s)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--mb", type=int, default=64, help="MiB of float32 K/V for the throughput runs")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()

    model = args.model or train_tiny_checkpoint(tempfile.mkdtemp(prefix="pdserve-tiny-"), seconds=45)
    kv = capture_kv(model, split_corpus()[1], max_tokens=args.tokens)  # [2, layers, T, kv_heads, head_dim]
    head_dim = kv.shape[-1]
    groups = [g for g in (16, 32, 64, 128) if head_dim % g == 0]
    print(f"model {model}: K/V {tuple(kv.shape)} float32, torch threads {torch.get_num_threads()}")
    print(
        f"\nround-trip error (mean abs / max abs / relative = mean|err| / mean|x|), bytes per token-head "
        f"vs {head_dim * 2} bf16"
    )
    print(
        f"{'g':>4} {'mode':>5} {'bytes':>6} {'ratio':>6} | {'K mean':>8} {'K max':>8} {'K rel':>7} | "
        f"{'V mean':>8} {'V max':>8} {'V rel':>7}"
    )
    for g in groups:
        for asym in (False, True):
            nb = bytes_per_token_head(head_dim, g, asym)
            k, v = error_row(kv[0], g, asym), error_row(kv[1], g, asym)
            print(
                f"{g:>4} {'asym' if asym else 'sym':>5} {nb:>6} {nb / (2 * head_dim):>6.3f} | "
                f"{k[0]:>8.5f} {k[1]:>8.5f} {k[2]:>7.4%} | {v[0]:>8.5f} {v[1]:>8.5f} {v[2]:>7.4%}"
            )

    reps = max(1, (args.mb << 20) // (kv.numel() * 4))
    big = kv.repeat(1, 1, reps, 1, 1).contiguous()  # tiled real K/V
    nbytes = big.numel() * 4
    t_copy = best_seconds(lambda: big.clone(), args.iters)
    print(f"\nthroughput on {nbytes / 2**20:.0f} MiB float32 K/V (best of {args.iters}), GB/s of dense bytes")
    print(f"{'op':>24} {'GB/s':>8} {'vs clone':>9}")
    print(f"{'torch.clone (memcpy)':>24} {nbytes / t_copy / 1e9:>8.2f} {1.0:>9.2f}")
    for g in groups:
        for asym in (False, True):
            q, s, z = quantize(big, g, asym)
            tq = best_seconds(lambda: quantize(big, g, asym), args.iters)
            td = best_seconds(lambda: dequantize(q, s, z, g, torch.float32), args.iters)
            mode = "asym" if asym else "sym"
            print(f"{f'quantize g={g} {mode}':>24} {nbytes / tq / 1e9:>8.2f} {t_copy / tq:>9.3f}")
            print(f"{f'dequantize g={g} {mode}':>24} {nbytes / td / 1e9:>8.2f} {t_copy / td:>9.3f}")


if __name__ == "__main__":
    main()
