"""Failover resume on an engine that prefills itself (colocated mode): `add_request(prompt + k generated tokens,
resumed_tokens=k, resumed_text_chars=c)` re-prefills them and continues exactly the uninterrupted stream: same
tokens (greedy and seeded), same text (text held back at the cut comes out after it), finish reason and usage."""

from __future__ import annotations

import pytest
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.sampling import SamplingParams

N = 24


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine("llama")


def uninterrupted(engine, prompt, sp) -> dict:
    engine.add_request("ref", prompt, sp)
    return run_to_completion(engine)["ref"]


def delivered_text(ref: dict, k: int) -> str:
    """The text a dead instance had delivered with its first k tokens."""
    text, n = "", 0
    for o in ref["outputs"]:
        n += len(o.new_token_ids)
        if n > k:
            break
        text += o.text_delta
    return text


def resumed(engine, prompt, sp, ref, k: int) -> dict:
    done, delivered = ref["tokens"][:k], delivered_text(ref, k)
    rid = f"resume-{k}"
    engine.add_request(rid, prompt + done, sp, resumed_tokens=k, resumed_text_chars=len(delivered))
    rest = run_to_completion(engine)[rid]
    assert engine.allocator.num_used == 0
    last = rest["outputs"][-1]
    return dict(
        tokens=done + rest["tokens"],
        text=delivered + rest["text"],
        finish=last.finish_reason,
        stop=last.stop_reason,
        usage=(last.num_prompt_tokens, last.num_completion_tokens),
    )


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=N, temperature=0.9, top_k=50, seed=11, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_colocated_resume_continues_the_same_stream(engine, sp):
    prompt = random_prompt(13, seed=77)
    ref = uninterrupted(engine, prompt, sp)
    assert len(ref["tokens"]) == N
    last = ref["outputs"][-1]
    for k in (1, 2, 5, 8, 13, N - 1):
        got = resumed(engine, prompt, sp, ref, k)
        assert got["tokens"] == ref["tokens"], k
        assert got["text"] == ref["text"], k
        assert (got["finish"], got["usage"]) == (last.finish_reason, (13, N)), k


def test_colocated_resume_with_a_stop_string_across_the_cut(engine):
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(9, seed=78)
    full = uninterrupted(engine, prompt, greedy)["text"]
    assert len(full) > 12
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop])
    ref = uninterrupted(engine, prompt, sp)
    assert ref["outputs"][-1].finish_reason == "stop" and ref["text"] == full[: full.index(stop)]
    for k in range(1, len(ref["tokens"])):
        got = resumed(engine, prompt, sp, ref, k)
        assert (got["tokens"], got["text"], got["finish"], got["stop"]) == (ref["tokens"], ref["text"], "stop", stop), k


def test_colocated_resume_arguments_are_checked(engine):
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = random_prompt(10, seed=79)
    bad = [
        dict(resumed_tokens=10),  # the whole prompt
        dict(resumed_tokens=4),  # >= max_tokens
        dict(resumed_tokens=2, resumed_text_chars=10_000),  # more text than the tokens make
        dict(resumed_text_chars=3),  # text without tokens
        dict(resumed_tokens=2, sampled_before=2),  # two ways to skip draws
        dict(resumed_tokens=2, prefill_only=True),
    ]
    for i, kw in enumerate(bad):
        with pytest.raises(ValueError):
            engine.add_request(f"bad-{i}", ids, sp, **kw)
    assert engine.allocator.num_used == 0 and not engine.has_unfinished_requests()
