"""Decode CUDA graphs of a TP=2 engine on two GPUs (NCCL): every rank captures its graphs with the all-reduces and the
logits' all-gather inside, rank 0's replays drive the follower's, and the teacher-forced logits equal the eager TP=2
engine's to bf16 rounding; greedy tokens through the graphs (chained steps included) equal TP=1's graphs. Needs two
sm90 GPUs, FA3 and triton; skipped elsewhere (the CPU parts: test_tp_graph_step.py)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import forced_logits, random_prompt

from pdserve.engine import kernels
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.device_count() < 2
    or torch.cuda.get_device_capability()[0] != 9
    or not kernels.HAVE_TRITON,
    reason="needs two CUDA sm90 GPUs and triton",
)
KW = dict(device="cuda:0", dtype="bfloat16", attention_backend="fa3", page_size=16, chunk_size=48, num_pages=96)
KW["max_num_seqs"] = 8
PROMPTS = [random_prompt(n, seed=n) for n in (1, 15, 16, 17, 70, 33)]


def run(make_engine, forced: list[list[int]] | None = None, **kw) -> tuple[list[list[int]], torch.Tensor, dict]:
    """Greedy tokens of PROMPTS (batched: the decode batch shrinks), the teacher-forced logits of `forced` (default:
    those tokens), and what the runner looked like; then the engine's ranks are stopped (one TP group per
    process)."""
    engine = make_engine("llama_hd64", **KW, **kw)
    runner = engine.runner
    seen = {
        "graphs": type(runner.graph_runner).__name__ if runner.graph_runner is not None else None,
        "sizes": list(runner.graph_runner.sizes) if runner.graph_runner is not None else [],
        "mode": getattr(runner.graph_runner, "capture_error_mode", None),
    }
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = engine.generate(PROMPTS, sp)
    logits = forced_logits(engine, PROMPTS, tokens if forced is None else forced)
    if runner._supervisor is not None:
        runner._supervisor.stop()
    return tokens, logits, seen


def test_tp2_decode_graphs_hold_the_collectives_and_match_eager(make_engine):
    eager_tokens, eager_logits, eager = run(make_engine, tensor_parallel_size=2, cuda_graphs=False)
    graph_tokens, graph_logits, graph = run(make_engine, eager_tokens, tensor_parallel_size=2)
    assert eager["graphs"] is None
    assert graph["graphs"] == "LeaderGraphs" and graph["sizes"] and graph["mode"] == "thread_local"
    assert graph_logits.isfinite().all()
    # the same kernels and collectives; padded graph batches change GEMM shapes: bf16-rounding-level differences
    assert ((graph_logits - eager_logits).norm() / eager_logits.norm()).item() < 2e-2
    one_tokens, one_logits, one = run(make_engine, eager_tokens)  # TP=1 with its graphs
    assert one["mode"] == "global"
    assert ((graph_logits - one_logits).norm() / one_logits.norm()).item() < 2e-2
    same = sum(a == b for a, b in zip(graph_tokens, one_tokens))
    print(f"TP=2 graphs vs TP=1 graphs: {same}/{len(PROMPTS)} greedy runs identical; vs eager TP=2: "
          f"{sum(a == b for a, b in zip(graph_tokens, eager_tokens))}/{len(PROMPTS)}")  # fmt: skip
    assert same >= len(PROMPTS) - 1  # bf16 all-reduce order may flip a near-tie in one long run
