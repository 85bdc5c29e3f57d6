"""Our model + paged KV + chunked prefill vs Hugging Face transformers on the same checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import assert_same_greedy, hf_generate, random_prompt, run_to_completion

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

PAGE, CHUNK, NEW = 4, 8, 16
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """hf_greedy(name, prompt) -> (tokens, per-step logits [NEW, V]) from HF generate(do_sample=False)."""
    cache: dict = {}

    def run(name: str, prompt: list[int]):
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_generate(hf_model(name), prompt, NEW)
        return cache[key]

    return run


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama_variant"])
def test_prefill_logits_match_hf(name, make_engine, hf_model):
    """All-position logits of a 3-chunk prompt, computed chunk by chunk through the paged cache."""
    engine = make_engine(name)
    prompt = random_prompt(3 * CHUNK + 5, seed=7)
    with torch.no_grad():
        ref = hf_model(name)(torch.tensor([prompt])).logits[0].float()  # [T, V]
    pages = engine.allocator.allocate(-(-len(prompt) // PAGE))
    rows = []
    for start in range(0, len(prompt), CHUNK):
        ids = prompt[start : start + CHUNK]
        runner = engine.runner
        meta = AttentionMetadata([start], [len(ids)], [pages], PAGE, runner.device)
        hidden = runner.model(torch.tensor(ids), meta, runner.kv_cache, runner.backend)
        rows.append(runner.model.compute_logits(hidden))
    engine.allocator.free(pages)
    ours = torch.cat(rows)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_greedy_matches_hf_each_length(name, make_engine, hf_greedy):
    engine = make_engine(name)
    for n in LENGTHS:
        prompt = random_prompt(n, seed=100 + n)
        ours = engine.generate([prompt], GREEDY)[0]
        ref, logits = hf_greedy(name, prompt)
        assert_same_greedy(ours, ref, logits, f"{name} prompt_len={n}")
    assert engine.allocator.num_used == 0


def test_greedy_matches_hf_variant(make_engine, hf_greedy):
    """head_dim from config, attention + MLP bias, llama3 RoPE scaling."""
    engine = make_engine("llama_variant")
    prompts = [random_prompt(n, seed=300 + n) for n in (PAGE + 1, 3 * CHUNK + 5)]
    for prompt, ours in zip(prompts, engine.generate(prompts, GREEDY)):
        ref, logits = hf_greedy("llama_variant", prompt)
        assert_same_greedy(ours, ref, logits, f"llama_variant prompt_len={len(prompt)}")


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_greedy_batch_of_mixed_lengths(name, make_engine, hf_greedy):
    engine = make_engine(name)
    prompts = [random_prompt(n, seed=100 + n) for n in LENGTHS]
    for prompt, ours in zip(prompts, engine.generate(prompts, GREEDY)):
        ref, logits = hf_greedy(name, prompt)
        assert_same_greedy(ours, ref, logits, f"{name} batched prompt_len={len(prompt)}")
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_requests_join_mid_decode(name, make_engine, hf_greedy):
    """Requests added while others are decoding (and while a long prompt is mid-prefill)."""
    engine = make_engine(name)
    first = {f"a{n}": random_prompt(n, seed=100 + n) for n in (PAGE, 3 * CHUNK + 5)}
    later = {f"b{n}": random_prompt(n, seed=100 + n) for n in (1, CHUNK + 1)}
    for rid, p in first.items():
        engine.add_request(EngineRequest(rid, p, GREEDY))
    collected: dict[str, list[int]] = {}
    for _ in range(4):  # long prompt still prefilling, short one decoding
        for o in engine.step():
            collected.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert collected.get(f"a{PAGE}"), "short request should be decoding by now"
    for rid, p in later.items():
        engine.add_request(EngineRequest(rid, p, GREEDY))
    for rid, r in run_to_completion(engine).items():
        collected.setdefault(rid, []).extend(r["tokens"])
    for rid, p in {**first, **later}.items():
        ref, logits = hf_greedy(name, p)
        assert_same_greedy(collected[rid], ref, logits, f"{name} {rid}")
    assert engine.allocator.num_used == 0


def test_preemption_recompute_keeps_greedy_output(make_engine, hf_greedy, monkeypatch):
    """A pool too small for all sequences: the newest is preempted, recomputed, and still matches HF."""
    engine = make_engine("llama", num_pages=14, max_num_seqs=4)
    preempted: list[str] = []
    real = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda s: (preempted.append(s.request_id), real(s)))
    prompts = [random_prompt(n, seed=100 + n) for n in (CHUNK + 1, CHUNK, CHUNK - 1, PAGE + 1)]
    # each needs ceil((len + 16) / 4) = 5..7 pages at the end: 4 together cannot fit in 14 pages
    for prompt, ours in zip(prompts, engine.generate(prompts, GREEDY)):
        ref, logits = hf_greedy("llama", prompt)
        assert_same_greedy(ours, ref, logits, f"preempted prompt_len={len(prompt)}")
    assert preempted, "the pool was meant to force preemption"
    assert engine.allocator.num_used == 0


def test_forced_tokens_and_returned_logits_match_hf(make_engine, hf_model):
    """Teacher forcing: the forced tokens are emitted and each step's logits row equals HF's at that position."""
    engine = make_engine("qwen2")
    prompt, forced = random_prompt(CHUNK + 3, seed=5), random_prompt(10, seed=6)
    sp = SamplingParams(max_tokens=len(forced), temperature=0.7, seed=1, ignore_eos=True)
    engine.add_request(EngineRequest("f", prompt, sp, forced_token_ids=forced))
    tokens, rows = [], []
    while engine.has_unfinished_requests():
        for o in engine.step(return_logits=True):
            tokens += o.new_token_ids
            rows.append(o.logits)
    assert tokens == forced
    with torch.no_grad():
        ref = hf_model("qwen2")(torch.tensor([prompt + forced])).logits[0, len(prompt) - 1 : -1].float()
    ours = torch.stack(rows)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < 1e-4
