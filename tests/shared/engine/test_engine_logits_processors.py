"""Penalties, logit_bias and min_tokens: the batched sampler changes against a per-row reference of OpenAI's and
HF's formulas, and their effect through a real engine (tiny random-weight llama on CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.logits_processors import LogitsPlan, apply_bitmask
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidRequest

V = 64
EOS = [2]


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams) -> torch.Tensor:
    """One row, token by token: HF's repetition penalty, OpenAI's frequency / presence penalties and logit_bias, the
    min_tokens ban."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        x[t] -= output.count(t) * sp.frequency_penalty + sp.presence_penalty
    for t, b in sp.logit_bias.items():
        x[t] += b
    if len(output) < sp.min_tokens:
        for t in set(EOS) | set(sp.stop_token_ids):
            x[t] = float("-inf")
    return x


def seq(prompt: list[int], output: list[int], prior: int = 0, **kw) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(max_tokens=64, **kw))
    s.completion_token_ids = list(output)
    s.num_prior_output_tokens = prior
    return s


CASES = [
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-1.3),
    dict(frequency_penalty=-2.0, presence_penalty=2.0),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.5, frequency_penalty=0.25),
    dict(logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    dict(min_tokens=10, stop_token_ids=[5]),
    dict(min_tokens=10, ignore_eos=True, stop_token_ids=[5]),
    dict(),  # a batch mate that asks for nothing: its row is unchanged
]


def test_batch_matches_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), V, generator=g) * 3
    seqs = []
    for i, kw in enumerate(CASES):
        ids = torch.randint(0, V, (20,), generator=g).tolist()
        seqs.append(seq(ids[:12], ids[12 : 12 + i], **kw))
    plan = LogitsPlan.build(seqs, V, EOS)
    assert plan is not None
    got = plan.apply(logits)
    for r, s in enumerate(seqs):
        sp = s.sampling
        want = reference(logits[r], s.prompt_token_ids, s.completion_token_ids, sp)
        if sp.ignore_eos:  # EOS is not a stop: only the stop token is banned
            want[EOS[0]] = reference(logits[r], s.prompt_token_ids, s.completion_token_ids, SamplingParams())[EOS[0]]
        torch.testing.assert_close(got[r], want, msg=f"row {r}: {CASES[r]}")
    assert torch.equal(got[-1], logits[-1])


def test_resumed_tokens_count_as_output():
    """The prompt's last `num_prior_output_tokens` were generated before a failover: penalties count them."""
    logits = torch.randn(1, V)
    s = seq([4, 9, 9, 9], [9], prior=2, frequency_penalty=1.0)
    got = LogitsPlan.build([s], V, EOS).apply(logits)  # type: ignore[union-attr]
    torch.testing.assert_close(got[0], reference(logits[0], [4, 9], [9, 9, 9], s.sampling))


def test_no_plan_without_processing_and_logits_left_alone():
    assert LogitsPlan.build([seq([1, 2], [3]), seq([4], [])], V, EOS) is None
    logits = torch.randn(1, V)
    before = logits.clone()
    LogitsPlan.build([seq([1], [1], presence_penalty=1.0)], V, EOS).apply(logits)  # type: ignore[union-attr]
    assert torch.equal(logits, before)  # logprobs are taken from the model's logits


def test_apply_bitmask_layout():
    allowed = [0, 31, 32, 63]
    words = torch.zeros(1, 2, dtype=torch.int64)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    mask = words.to(torch.int32)  # bit 31 wraps to a negative int32, as xgrammar stores it
    out = apply_bitmask(torch.zeros(1, V), mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == allowed


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logit_bias={600: 1.0}), "vocabulary"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
        (dict(min_tokens=17), "min_tokens"),
    ],
)
def test_validation(llama_engine, bad, reason):
    with pytest.raises(InvalidRequest, match=reason):
        llama_engine.add_request(EngineRequest("bad", [5, 6, 7], SamplingParams(max_tokens=16, **bad)))


def test_min_tokens_and_ignore_eos_give_max_tokens(llama_engine):
    """EOS forced by logit_bias +100: without min_tokens the request ends at once; with min_tokens the first
    min_tokens tokens are not EOS; with ignore_eos it runs to max_tokens."""
    eos = llama_engine.model_config.eos_token_ids[0]
    prompt = random_prompt(9, seed=3)
    cases = {
        "plain": SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100.0}),
        "min": SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100.0}, min_tokens=5),
        "ignore": SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True, min_tokens=12, seed=1),
    }
    for rid, sp in cases.items():
        llama_engine.add_request(EngineRequest(rid, prompt, sp))
    res = run_to_completion(llama_engine)
    assert res["plain"]["tokens"] == [eos]
    assert len(res["min"]["tokens"]) == 6 and eos not in res["min"]["tokens"][:5] and res["min"]["tokens"][5] == eos
    assert len(res["ignore"]["tokens"]) == 12 and res["ignore"]["outputs"][-1].finish_reason == "length"


def test_penalties_change_greedy_output_and_bias_bans(llama_engine):
    prompt = random_prompt(9, seed=4)
    plain = SamplingParams(max_tokens=24, temperature=0)
    llama_engine.add_request(EngineRequest("plain", prompt, plain))
    base = run_to_completion(llama_engine)["plain"]["tokens"]
    banned = {t: -100.0 for t in set(base)}
    llama_engine.add_request(
        EngineRequest("ban", prompt, SamplingParams(max_tokens=24, temperature=0, logit_bias=banned))
    )
    llama_engine.add_request(
        EngineRequest("freq", prompt, SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0))
    )
    res = run_to_completion(llama_engine)
    assert not set(res["ban"]["tokens"]) & set(banned)
    freq = res["freq"]["tokens"]
    assert max(freq.count(t) for t in set(freq)) <= max(base.count(t) for t in set(base))
