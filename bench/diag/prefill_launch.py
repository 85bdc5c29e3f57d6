"""The host side of a prefill chunk's forward: the engine thread's wall and CPU time to launch it, in-process (no
service beside it), per chunk length, and where that CPU time goes (cProfile of the launches, by own time).

    python bench/diag/prefill_launch.py --model DIR [--tokens 128,416,2048] [--reps 5] [--top 40]

A chunk whose launch takes longer than its GPU time leaves the GPU idle: `launch` against `step` (the whole engine
step to the sampled token, synchronized) says which bounds it. Each length runs eagerly and, where the engine
captured them, through the piecewise prefill graphs (prefill_graphs.py), alternated on the same engine and
weights. Figures: docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
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
    ap.add_argument("--top", type=int, default=0, help="cProfile the launches: this many rows by own time (0: off)")
    ap.add_argument("--kv-dtype", default="int8")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(EngineConfig(model_dir=args.model, kv_dtype=args.kv_dtype, max_num_seqs=8))
    runner = engine.runner
    graphs = runner.prefill_graphs
    modes = {"eager": None} | ({"graphs": graphs} if graphs is not None else {})
    print(f"prefill graph buckets: {graphs.buckets if graphs else 'none'}")
    k = 0
    for n in (int(x) for x in args.tokens.split(",")):
        got: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for rep in range(args.reps + 2):  # modes alternated; the first two rounds warm up
            for mode, g in modes.items():
                runner.prefill_graphs = g
                r = prefill(engine, n, f"r{k}")
                k += 1
                if rep >= 2:
                    got[mode].append(r)
        for mode in modes:
            med = [statistics.median(g[i] for g in got[mode]) for i in range(3)]
            print(
                f"{n:>5} tokens {mode:>6}: launch {med[0]:.2f} ms (CPU {med[1]:.2f} ms), step {med[2]:.2f} ms", end=""
            )
            print(f" (medians of {args.reps})")
        if args.top <= 0:
            continue
        for mode, g in modes.items():
            runner.prefill_graphs = g
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.reps):
                prefill(engine, n, f"p{k}")
                k += 1
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"--- {n} tokens, {mode}")
            print(out.getvalue())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    runner.prefill_graphs = graphs


if __name__ == "__main__":
    main()
