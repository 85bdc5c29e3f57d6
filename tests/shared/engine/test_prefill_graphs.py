"""Piecewise prefill graphs (prefill_graphs.py) on CPU: the segments, static buffers, padding and bucket choice
run through the engine with a recorder whose "graph" is the segment itself (no CUDA graph can exist here; the GPU
test test_engine_gpu_prefill_graphs.py replays real ones). Outputs must be the eager forward's."""

from __future__ import annotations

import contextlib

import pytest
import torch
from engine_testutil import random_prompt

from pdserve.engine.config import EngineConfig
from pdserve.engine.prefill_graphs import PrefillGraphRunner, buckets_up_to, capture_or_release, prefill_graph_mode
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams


class EagerRecorder:
    """`Recorder`'s interface; replaying a segment runs it."""

    def __init__(self):
        self.recorded = 0

    def session(self):
        return contextlib.nullcontext()

    def sync(self) -> None:
        pass

    def record(self, fn):
        self.recorded += 1
        return fn

    def clear(self) -> None:
        self.recorded = 0


class SkipPaddingWrites:
    """The pool as the fused K/V write sees it: rows at slot < 0 (padding) are not written (the torch path's
    index_copy_ would refuse them)."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def write(self, layer, slot_ids, k, v):
        keep = slot_ids >= 0
        self._cache.write(layer, slot_ids[keep], k[keep], v[keep])


def with_graphs(engine, buckets):
    r = engine.runner
    graphs = PrefillGraphRunner(
        r.model, SkipPaddingWrites(r.kv_cache), r.backend, r.device, buckets, recorder := EagerRecorder()
    )
    graphs.capture()
    assert recorder.recorded == len(buckets) * (r.model_config.num_layers + 1)
    r.prefill_graphs = graphs
    return graphs


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, GREEDY))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.allocator.num_used == 0
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama_variant"])
def test_graph_steps_give_the_eager_tokens(make_engine, name):
    """Prompts at bucket and page edges, alone and batched (mixed steps: decode rows beside prefill chunks), and
    chunks longer than the largest bucket (those run eagerly)."""
    kw = dict(chunk_size=24, page_size=4)
    prompts = [random_prompt(n, seed=n) for n in (1, 3, 4, 5, 8, 9, 23, 40)]
    eager = make_engine(name, **kw)
    want = [run(eager, [p])[0] for p in prompts]
    graph = make_engine(name, **kw)
    graphs = with_graphs(graph, [4, 8, 16])
    used: list[int] = []
    forward = graphs.forward
    graphs.forward = lambda ids, meta: used.append(graphs.bucket(len(ids))) or forward(ids, meta)  # type: ignore[method-assign]
    assert [run(graph, [p])[0] for p in prompts] == want
    assert run(graph, prompts) == want  # batched: mixed steps
    assert {4, 8, 16} <= set(used)
    steps = graph.runner.steps_launched
    assert steps["prefill_graph"] == len(used) and steps["eager"] > 0 and steps["decode_graph"] == 0  # CPU


def test_graph_forward_matches_eager_hidden_states(make_engine):
    """One forward's hidden states, row for row, for a step that pads (5 tokens in a bucket of 8), then one that
    fills its bucket exactly, over the same pool."""
    e = make_engine("llama", page_size=4)
    r = e.runner
    graphs = with_graphs(e, [8])
    model, cache = r.model, r.kv_cache
    tables = [[3, 7]]
    graph_hidden = graphs.forward([5, 6, 7, 8, 9], _meta(r, [0], [5], tables)).clone()
    pool_after_graph = cache.data.clone()
    cache.data.zero_()
    eager_hidden = model(torch.tensor([5, 6, 7, 8, 9]), _meta(r, [0], [5], tables), cache, r.backend)
    torch.testing.assert_close(graph_hidden, eager_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.data, pool_after_graph, rtol=1e-5, atol=1e-5)  # the same K/V, nothing else
    tables = [[3, 7, 9, 11]]  # the same sequence's next 8 tokens (positions 5..12): the bucket exactly
    ids = list(range(20, 28))
    graph_hidden = graphs.forward(ids, _meta(r, [5], [8], tables)).clone()
    cache_graph = cache.data.clone()
    cache.data.copy_(pool_after_graph)
    eager_hidden = model(torch.tensor(ids), _meta(r, [5], [8], tables), cache, r.backend)
    torch.testing.assert_close(graph_hidden, eager_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.data, cache_graph, rtol=1e-5, atol=1e-5)


def _meta(runner, starts, q_lens, tables):
    from pdserve.engine.attention import AttentionMetadata

    return AttentionMetadata(starts, q_lens, tables, runner.page_size, runner.device)


def test_capture_and_padding_write_nothing_to_the_pool(make_engine):
    e = make_engine("llama", page_size=4)
    cache = e.runner.kv_cache
    cache.data.normal_()
    before = cache.data.clone()
    graphs = with_graphs(e, [8, 16])
    assert torch.equal(cache.data, before)  # capture: every row is padding
    graphs.forward([1, 2, 3], _meta(e.runner, [0], [3], [[5]]))  # 3 rows in a bucket of 8
    changed = (cache.data != before).flatten(3).any(-1)  # [2, L, pages]
    assert changed.any(dim=1).any(dim=0).nonzero().flatten().tolist() == [5]  # page 5 only


def test_layer_hook_runs_after_each_layer_in_order(make_engine):
    e = make_engine("llama", page_size=4)
    graphs = with_graphs(e, [8])
    seen: list[int] = []
    e.runner.model.layer_hook = seen.append
    try:
        graphs.forward([1, 2, 3], _meta(e.runner, [0], [3], [[2]]))
    finally:
        e.runner.model.layer_hook = None
    assert seen == list(range(e.runner.model_config.num_layers))


def test_buckets_and_when_graphs_are_captured():
    assert buckets_up_to(0) == []
    assert buckets_up_to(16) == [16]
    assert buckets_up_to(100) == [16, 32, 64, 112]
    assert buckets_up_to(300) == [16, 32, 64, 128, 256, 304]
    assert buckets_up_to(1024)[-3:] == [768, 896, 1024]
    assert buckets_up_to(2048)[-3:] == [1536, 1792, 2048]
    assert buckets_up_to(4096)[-2:] == [2048, 4096]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert prefill_graph_mode(1024, True, cuda, True, "fa3", None) == ("thread_local", "")
    assert prefill_graph_mode(0, True, cuda, True, "fa3", None)[1] == "disabled"
    assert prefill_graph_mode(1024, False, cuda, True, "fa3", None)[1] == "disabled"  # --cuda-graphs off
    assert prefill_graph_mode(1024, True, cpu, True, "fa3", None)[0] == ""
    assert prefill_graph_mode(1024, True, cuda, True, "triton-rows", None)[0] == ""
    assert prefill_graph_mode(1024, True, cuda, True, "fa3", object())[1] == "not at tensor parallel"


def test_cpu_engine_has_no_prefill_graphs_and_the_setting_is_checked(llama_engine, checkpoint):
    assert llama_engine.runner.prefill_graphs is None
    for bad in (-2, 8193):
        with pytest.raises(ValueError, match="prefill_graph_tokens"):
            EngineConfig(model_dir=str(checkpoint("llama")), prefill_graph_tokens=bad).validate()
    cfg = lambda **kw: EngineConfig(model_dir="m", **kw)  # noqa: E731
    assert cfg().graph_step_tokens() == 2048 + 64  # auto: a full chunk beside a full decode batch
    assert cfg(step_token_budget=4096, max_num_seqs=8).graph_step_tokens() == 4104
    assert cfg(step_token_budget=-1).graph_step_tokens() == 2112  # colocated auto budget: not known at load
    assert cfg(chunk_size=8192).graph_step_tokens() == 8192
    assert cfg(prefill_graph_tokens=512).graph_step_tokens() == 512
    assert cfg(prefill_graph_tokens=0).graph_step_tokens() == 0


def test_a_capture_that_runs_out_of_memory_leaves_the_engine_eager(make_engine, caplog):
    """The graphs live outside the memory share the KV pool was sized from: a capture that runs out of device
    memory drops the graphs (the engine then launches every step eagerly) instead of failing the start."""
    e = make_engine("llama", page_size=4)
    r = e.runner

    class OutOfMemoryAtThird(EagerRecorder):
        def record(self, fn):
            if self.recorded == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 58.00 MiB")
            return super().record(fn)

    graphs = PrefillGraphRunner(r.model, SkipPaddingWrites(r.kv_cache), r.backend, r.device, [8], OutOfMemoryAtThird())
    with caplog.at_level("WARNING", logger="pdserve.engine"):
        assert not capture_or_release(graphs)
    assert not graphs.replays and not graphs.can_run(4) and graphs.recorder.recorded == 0
    assert "prefill CUDA graphs off" in caplog.text and "OutOfMemoryError" in caplog.text
    ok = PrefillGraphRunner(r.model, SkipPaddingWrites(r.kv_cache), r.backend, r.device, [8], EagerRecorder())
    assert capture_or_release(ok) and ok.can_run(8)


def test_graph_steps_keep_prompt_logprobs_sampling_and_forks(make_engine):
    """What a step reads off the hidden states besides the last row: prompt logprobs of every chunk (all rows of
    the static buffer's view), sampled tokens with their logprobs, and n > 1 forks, equal to eager."""
    prompt = random_prompt(21, seed=7)  # chunks of 8: 8, 8, 5 (buckets 8, 8, 8)
    params = [
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=5, temperature=1.1, seed=3, ignore_eos=True, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=4, temperature=0.9, seed=5, ignore_eos=True),  # n = 2 below
    ]

    def outputs(engine) -> list[tuple]:
        got = []
        for k, sp in enumerate(params):
            engine.add_request(EngineRequest(f"q{k}", prompt, sp, n=2 if k == 2 else 1))
            toks: dict[int, list[int]] = {}
            lps, plps = [], []
            while engine.has_unfinished_requests():
                for o in engine.step():
                    toks.setdefault(o.index, []).extend(o.new_token_ids)
                    lps += [(lp.token_id, round(lp.logprob, 5)) for lp in o.logprobs]
                    plps += [(lp.token_id, round(lp.logprob, 5), [t for t, _ in lp.top]) for lp in o.prompt_logprobs]
            got.append((toks, lps, plps))
        assert engine.allocator.num_used == 0
        return got

    want = outputs(make_engine("llama", page_size=4, chunk_size=8))
    graph = make_engine("llama", page_size=4, chunk_size=8)
    with_graphs(graph, [8, 16])
    got = outputs(graph)
    assert got == want
    assert len(want[0][2]) == 20 and len(want[2][0]) == 2  # every prompt position scored; two forks
    assert graph.runner.steps_launched["prefill_graph"] >= 9
