"""Sampling (seeds, top-k/top-p, validation), stop conditions and incremental detokenization."""

from __future__ import annotations

import math

import pytest
import torch
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams, sample
from pdserve.engine.sequence import IncrementalDetokenizer

RANDOM = dict(temperature=0.9, top_p=0.9, top_k=50)


def text_prompt(engine, text: str = "The quick brown fox jumps over the lazy dog.") -> list[int]:
    return engine.tokenizer.encode(text)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2000), "context"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-2]), "stop_token_ids"),
        (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop strings"),  # every decode step scans them
        (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), "characters"),
        (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ],
)
def test_validate_rejects_with_reason(bad, reason):
    with pytest.raises(ValueError, match=reason):
        SamplingParams(**bad).validate(1024)


def test_validate_accepts_defaults_and_edges():
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, stop=["x"], stop_token_ids=[0]).validate(16)
    at_ceiling = dict(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    SamplingParams(**at_ceiling).validate(16)


def test_sampler_top_k_one_is_argmax_and_top_p_keeps_head():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, generator=g)
    best = int(logits.argmax())
    for s in range(20):
        gen = torch.Generator().manual_seed(s)
        assert sample(logits, SamplingParams(temperature=1.0, top_k=1), gen) == best
        assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), gen) == best
    picks = {
        sample(logits, SamplingParams(temperature=1.0, top_k=3), torch.Generator().manual_seed(s)) for s in range(200)
    }
    assert picks <= set(torch.topk(logits, 3).indices.tolist()) and len(picks) > 1


def test_seed_determinism_independent_of_batch(llama_engine):
    e = llama_engine
    prompt = random_prompt(9, seed=1)
    sp = SamplingParams(max_tokens=12, seed=1234, ignore_eos=True, **RANDOM)
    alone = e.generate([prompt], sp)[0]
    mates = [random_prompt(n, seed=50 + n) for n in (3, 17, 30)]
    batched = e.generate(
        [mates[0], prompt, mates[1], mates[2]],
        [
            SamplingParams(max_tokens=12, ignore_eos=True, **RANDOM),
            sp,
            SamplingParams(max_tokens=5, seed=7, **RANDOM),
            SamplingParams(max_tokens=12, temperature=0),
        ],
    )
    assert batched[1] == alone
    other_seed = e.generate([prompt], SamplingParams(max_tokens=12, seed=99, ignore_eos=True, **RANDOM))[0]
    assert other_seed != alone


def test_top_k_one_equals_greedy(llama_engine):
    e = llama_engine
    prompts = [random_prompt(n, seed=n) for n in (4, 13)]
    greedy = e.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    topk1 = e.generate(prompts, SamplingParams(max_tokens=10, temperature=1.3, top_k=1, ignore_eos=True))
    assert topk1 == greedy


def greedy_run(engine, prompt, **kw):
    engine.add_request(EngineRequest("ref", prompt, SamplingParams(temperature=0.0, **kw)))
    return run_to_completion(engine)["ref"]


def test_max_tokens_finishes_with_length(llama_engine):
    r = greedy_run(llama_engine, random_prompt(5, 2), max_tokens=7, ignore_eos=True)
    last = r["outputs"][-1]
    assert len(r["tokens"]) == 7 and last.finished and last.finish_reason == "length"
    assert last.num_completion_tokens == 7 and last.num_prompt_tokens == 5


def test_stop_token_ids(llama_engine):
    e = llama_engine
    prompt = random_prompt(6, 3)
    ref = greedy_run(e, prompt, max_tokens=12, ignore_eos=True)["tokens"]
    tok = ref[4]
    j = ref.index(tok)
    r = greedy_run(e, prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[tok])
    last = r["outputs"][-1]
    assert r["tokens"] == ref[: j + 1]
    assert (last.finish_reason, last.stop_reason) == ("stop", f"token:{tok}")


def test_eos_stops_unless_ignored(llama_engine):
    e = llama_engine
    eos = e.model_config.eos_token_ids[0]
    prompt = random_prompt(5, 4)
    forced = [7, 8, eos, 9, 10]
    e.add_request(EngineRequest("eos", prompt, SamplingParams(max_tokens=5, temperature=0.0), forced_token_ids=forced))
    e.add_request(
        EngineRequest(
            "ign", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), forced_token_ids=forced
        )
    )
    res = run_to_completion(e)
    assert res["eos"]["tokens"] == forced[:3]
    assert (res["eos"]["outputs"][-1].finish_reason, res["eos"]["outputs"][-1].stop_reason) == ("stop", "eos")
    assert res["ign"]["tokens"] == forced and res["ign"]["outputs"][-1].finish_reason == "length"
    assert "</s>" not in res["eos"]["text"]


def test_stop_string_truncates_and_never_leaks(llama_engine):
    e = llama_engine
    prompt = text_prompt(e)
    ref = greedy_run(e, prompt, max_tokens=24, ignore_eos=True)
    full = ref["text"]
    assert len(full) > 12, full
    stop = full[8:11]
    idx = full.find(stop)
    r = greedy_run(e, prompt, max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"])
    last = r["outputs"][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert r["text"] == full[:idx]
    emitted = ""
    for o in r["outputs"]:
        emitted += o.text_delta
        assert stop not in emitted
    assert len(r["tokens"]) < 24


def test_held_back_text_is_flushed_when_finishing_for_length(llama_engine):
    e = llama_engine
    prompt = text_prompt(e)
    ref = greedy_run(e, prompt, max_tokens=10, ignore_eos=True)
    full = ref["text"]
    # a stop string whose first char is the last emitted char but that never completes
    r = greedy_run(e, prompt, max_tokens=10, ignore_eos=True, stop=[full[-1] + "\x00\x01"])
    assert r["text"] == full and r["outputs"][-1].finish_reason == "length"


def test_incremental_detokenizer_unicode(llama_engine):
    tok = llama_engine.tokenizer
    text = "héllo wörld — ünïcødé 日本語 ok"
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add(t) for t in ids]
    assert all(not s.endswith("\ufffd") for s in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    assert any(s == "" for s in deltas)  # multi-byte characters were held back at least once


def test_text_deltas_match_full_decode(llama_engine):
    e = llama_engine
    r = greedy_run(e, text_prompt(e), max_tokens=20, ignore_eos=True)
    full = e.tokenizer.decode(r["tokens"], skip_special_tokens=True)
    assert r["text"] == full.rstrip("\ufffd")
