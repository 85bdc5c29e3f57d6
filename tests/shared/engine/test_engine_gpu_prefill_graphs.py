"""Piecewise prefill CUDA graphs (prefill_graphs.py) on a Hopper GPU: the same logits as the eager forward (bit for
bit where the step fills its bucket, bf16-rounding level where it pads: padded GEMMs may pick other kernels), pool
contents identical, the layer hook between replays, and far less host time a step (skipped without CUDA sm90,
FA3 and triton)."""

from __future__ import annotations

import time

import pytest
import torch
from engine_testutil import forced_logits, random_prompt, skip_without_fa3_gpu

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.sampling import SamplingParams

KW = dict(
    device="cuda", dtype="bfloat16", attention_backend="fa3", page_size=16, chunk_size=80, num_pages=128, max_num_seqs=8
)


@pytest.fixture(scope="module", autouse=True)
def fa3_gpu():
    skip_without_fa3_gpu()


PROMPTS = [random_prompt(n, seed=n) for n in (1, 15, 16, 17, 33, 64, 70, 150)]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_graph_prefill_matches_eager(make_engine, kv):
    """Each prompt alone (<= 64 tokens: graphs; 70 and 150: chunks past the largest bucket, eager), then all of
    them batched (mixed steps of up to 80 tokens: graphs where they fit)."""
    eager = make_engine("llama_hd64", **KW, kv_dtype=kv, prefill_graph_tokens=0)
    graph = make_engine("llama_hd64", **KW, kv_dtype=kv, prefill_graph_tokens=64)
    assert eager.runner.prefill_graphs is None
    pg = graph.runner.prefill_graphs
    assert pg is not None and pg.buckets == [16, 32, 64]
    steps: list[int] = []
    forward = pg.forward
    pg.forward = lambda ids, meta: steps.append(len(ids)) or forward(ids, meta)  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    forced = eager.generate(PROMPTS, greedy)
    for prompts, fc in [([p], [f]) for p, f in zip(PROMPTS, forced)] + [(PROMPTS, forced)]:
        le, lg = forced_logits(eager, prompts, fc), forced_logits(graph, prompts, fc)
        assert lg.isfinite().all()
        assert ((lg - le).norm() / le.norm()).item() < 2e-2, len(prompts[0])
    # (the 1-token prompt is a decode row: the decode graphs take it)
    assert steps and max(steps) <= 64 and {15, 16, 17, 33, 64} <= set(steps)


def test_full_bucket_is_bit_identical_and_pool_equal(make_engine):
    e = make_engine("llama_hd64", **KW, kv_dtype="int8", prefill_graph_tokens=32)
    r = e.runner
    pg = r.prefill_graphs
    assert pg is not None
    ids = random_prompt(32, seed=5)
    meta = lambda: AttentionMetadata([0], [32], [[4, 9]], 16, r.device)  # noqa: E731
    hook_calls: list[int] = []
    r.model.layer_hook = hook_calls.append
    try:
        g = pg.forward(ids, meta()).clone()
    finally:
        r.model.layer_hook = None
    assert hook_calls == list(range(r.model_config.num_layers))
    pool = r.kv_cache.data.clone()
    r.kv_cache.data.zero_()
    eager = r.model(torch.tensor(ids, device=r.device), meta(), r.kv_cache, r.backend)
    assert torch.equal(g, eager)
    assert torch.equal(r.kv_cache.data, pool)


def test_replays_launch_in_a_fraction_of_the_eager_host_time(tmp_path):
    """Host time to queue one 48-token forward of a 16-layer model (the device's work is tiny): the graph path
    launches a replay and one attention a layer instead of every kernel."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.models.checkpoints import build_checkpoint

    model_dir = build_checkpoint(tmp_path, arch="llama", head_dim=64, num_hidden_layers=16)
    e = LLMEngine(EngineConfig(model_dir=str(model_dir), **KW, kv_dtype="int8", prefill_graph_tokens=64))
    r = e.runner
    pg = r.prefill_graphs
    assert pg is not None
    ids = random_prompt(48, seed=6)

    def host_ms(fn) -> float:
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(ids, AttentionMetadata([0], [48], [[1, 2, 3]], 16, r.device))
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return sorted(times)[len(times) // 2] * 1e3

    graph_ms = host_ms(pg.forward)
    eager_ms = host_ms(lambda i, m: r.model(torch.tensor(i, device=r.device), m, r.kv_cache, r.backend))
    print(f"host ms per 48-token forward, 16 layers: graphs {graph_ms:.3f}, eager {eager_ms:.3f}")
    assert graph_ms < 0.6 * eager_ms
