"""Logprobs in the engine: generated tokens and prompt tokens (every chunk of a chunked prefill), both with top
alternatives, equal HF transformers' log_softmax on the same fp32 weights; forced tokens are scored as forced; the
decode CUDA graph path reports the same values as the eager path (GPU only)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidRequest

PROMPT = [5, 17, 99, 23, 8, 250, 31, 77, 12, 400, 3, 66, 90, 41, 7, 300, 11, 19, 45, 2, 9]  # 21: 3 chunks of 8


def run(engine, rid, prompt, sp):
    engine.add_request(EngineRequest(rid, prompt, sp))
    toks, lps, plps = [], [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.new_token_ids
            lps += o.logprobs
            plps += o.prompt_logprobs
    return toks, lps, plps


def hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_token_and_prompt_logprobs_equal_hf(make_engine, hf_model, temperature):
    engine = make_engine("qwen2")
    sp = SamplingParams(
        max_tokens=7,
        temperature=temperature,
        seed=4,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
        prompt_logprobs=True,
    )
    toks, lps, plps = run(engine, "a", PROMPT, sp)
    ref = hf_logprobs(hf_model("qwen2"), PROMPT + toks)
    n = len(PROMPT)
    assert [lp.token_id for lp in lps] == toks and len(lps) == 7
    for i, lp in enumerate(lps):
        row = ref[n - 1 + i]  # the untempered distribution, whatever the temperature
        assert lp.logprob == pytest.approx(row[toks[i]].item(), abs=1e-5)
        top = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert [lp.token_id for lp in plps] == PROMPT[1:]  # each prompt position scores the next prompt token
    assert [lp.logprob for lp in plps] == pytest.approx([ref[i, PROMPT[i + 1]].item() for i in range(n - 1)], abs=1e-5)
    for i, lp in enumerate(plps):  # and the same top_logprobs alternatives as a generated token
        top = torch.topk(ref[i], 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_no_logprobs_unless_asked(llama_engine):
    toks, lps, plps = run(llama_engine, "plain", PROMPT, SamplingParams(max_tokens=3, temperature=0))
    assert len(toks) == 3 and lps == [] and plps == []


def test_forced_tokens_are_scored_as_forced(make_engine, hf_model):
    engine = make_engine("llama")
    forced = [7, 8, 9, 10]
    engine.add_request(
        EngineRequest(
            "f",
            PROMPT,
            SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True),
            forced_token_ids=forced,
        )
    )
    lps = [lp for _ in iter(engine.has_unfinished_requests, False) for o in engine.step() for lp in o.logprobs]
    ref = hf_logprobs(hf_model("llama"), PROMPT + forced)
    assert [lp.token_id for lp in lps] == forced
    assert [lp.logprob for lp in lps] == pytest.approx(
        [ref[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(forced)], abs=1e-5
    )


def test_limits_and_cached_pages(llama_engine):
    for bad in (21, -1):
        with pytest.raises(InvalidRequest, match="top_logprobs"):
            llama_engine.add_request(EngineRequest("bad", PROMPT, SamplingParams(top_logprobs=bad)))
    pages = [object()]  # never inspected: prompt_logprobs refuses any cached prefix first
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        llama_engine.add_request(
            EngineRequest("cached", PROMPT, SamplingParams(prompt_logprobs=True), cached_pages=pages)
        )
    assert llama_engine.request_ids() == []


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a CUDA sm90 GPU (decode graphs)",
)
def test_graph_path_logprobs_come_from_the_graph_logits(make_engine):
    """Greedy decode through the captured graphs: every token has its logprob, computed from the graph's logits
    row (returned by return_logits), never dropped."""
    engine = make_engine(
        "llama_hd64",
        device="cuda",
        dtype="bfloat16",
        attention_backend="auto",
        page_size=16,
        chunk_size=48,
        num_pages=96,
        max_num_seqs=8,
    )
    if engine.runner.graph_runner is None:
        pytest.skip("no decode CUDA graphs on this machine (FA3 / fused path unavailable)")
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    engine.add_request(EngineRequest("g", PROMPT, sp))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step(return_logits=True)
    assert sum(len(o.logprobs) for o in outs) == sum(len(o.new_token_ids) for o in outs) == 6
    for o in outs:
        logp = torch.log_softmax(o.logits.float(), dim=-1)
        (lp,) = o.logprobs
        assert lp.token_id == o.new_token_ids[0] == int(logp.argmax())
        assert lp.logprob == pytest.approx(logp[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(logp, 3).indices.tolist()
