"""The host side of a prefill chunk's forward: the engine thread's wall and CPU time to launch it, in-process (no
service beside it), per chunk length, and where that CPU time goes (cProfile of the launches, by own time).

    python bench/diag/prefill_launch.py --model DIR [--tokens 128,416,2048] [--reps 5] [--top 40]

A chunk whose launch takes longer than its GPU time leaves the GPU idle: `launch` against `gpu` (the chunk's
forward timed on the device, synchronized) says which bounds it. Figures: docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams


def prefill(engine: LLMEngine, n: int, rid: str) -> tuple[float, float, float]:
    """One `n`-token prompt prefilled alone (one token generated): (launch wall ms, launch CPU ms, step wall ms)
    of its last chunk."""
    vocab = engine.model_config.vocab_size
    ids = [random.randrange(vocab // 4, vocab) for _ in range(n)]
    engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    runner = engine.runner
    t = 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        t = (time.perf_counter() - t0) * 1e3
    return runner.launch_wall_ns / 1e6, runner.launch_cpu_ns / 1e6, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", default="128,416,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--kv-dtype", default="int8")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model_dir=args.model, kv_dtype=args.kv_dtype, max_num_seqs=8))
    k = 0
    for n in (int(x) for x in args.tokens.split(",")):
        for _ in range(2):
            prefill(engine, n, f"w{k}")
            k += 1
        got = []
        for _ in range(args.reps):
            got.append(prefill(engine, n, f"r{k}"))
            k += 1
        med = [statistics.median(g[i] for g in got) for i in range(3)]
        print(f"{n:>5} tokens: launch {med[0]:.2f} ms (CPU {med[1]:.2f} ms), step {med[2]:.2f} ms", end="")
        print(f" (medians of {args.reps})")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            prefill(engine, n, f"p{k}")
            k += 1
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(out.getvalue())
        if torch.cuda.is_available():
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
