"""Failover resume: a request whose decode instance died after k tokens continues on another pair (prefill of
prompt + those k tokens, `sampled_before=k`; decode import with `resumed_tokens=k` and the characters already
delivered) and produces exactly the uninterrupted stream: same tokens (greedy and seeded sampling), same text
(text held back at the cut comes out after it), same finish reason and usage."""

from __future__ import annotations

import pytest
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.sampling import SamplingParams

N = 24


def uninterrupted(engine, prompt, sp) -> dict:
    engine.add_request("ref", prompt, sp)
    return run_to_completion(engine)["ref"]


def resumed(prefill_engine, decode_engine, prompt, sp, ref, k: int) -> dict:
    """The first k tokens (and their delivered text) came from the dead instance; the rest from here."""
    done = ref["tokens"][:k]
    delivered = ""
    for o in ref["outputs"]:  # the text the dead instance had delivered with its first k tokens
        if sum(len(x.new_token_ids) for x in ref["outputs"][: ref["outputs"].index(o) + 1]) > k:
            break
        delivered += o.text_delta
    rid = f"resume-{k}"
    ids = prompt + done
    prefill_engine.add_request(rid, ids, sp, prefill_only=True, sampled_before=k)
    pages, first = [], None
    while first is None:
        for o in prefill_engine.step():
            pages += prefill_engine.export_pages(rid, o.ready_pages, "auto")
            if o.finished:
                first = o.new_token_ids[0]
    prefill_engine.release(rid)
    decode_engine.begin_import(rid, ids, sp, resumed_tokens=k, resumed_text_chars=len(delivered))
    for p in pages:
        decode_engine.import_page(rid, p)
    decode_engine.finish_import(rid, first)
    rest = run_to_completion(decode_engine)[rid]
    assert decode_engine.allocator.num_used == 0 and prefill_engine.allocator.num_used == 0
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
def test_resume_continues_the_same_stream(prefill_engine, decode_engine, sp):
    prompt = random_prompt(13, seed=77)
    ref = uninterrupted(decode_engine, prompt, sp)
    assert len(ref["tokens"]) == N
    last = ref["outputs"][-1]
    for k in (1, 2, 5, 8, 13, N - 1):
        got = resumed(prefill_engine, decode_engine, prompt, sp, ref, k)
        assert got["tokens"] == ref["tokens"], k
        assert got["text"] == ref["text"], k
        assert (got["finish"], got["usage"]) == (last.finish_reason, (13, N)), k


def test_resume_with_a_stop_string_across_the_cut(prefill_engine, decode_engine):
    """A stop string taken from the middle of the reference text: cuts before, inside and after its first
    characters all end at the same place with the same text (text held back as a possible stop-string prefix
    was not delivered before the cut; it is delivered or dropped after it exactly as without the failure)."""
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(9, seed=78)
    full = uninterrupted(decode_engine, prompt, greedy)["text"]
    assert len(full) > 12
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop])
    ref = uninterrupted(decode_engine, prompt, sp)
    assert ref["outputs"][-1].finish_reason == "stop" and ref["text"] == full[: full.index(stop)]
    for k in range(1, len(ref["tokens"])):
        got = resumed(prefill_engine, decode_engine, prompt, sp, ref, k)
        assert (got["tokens"], got["text"], got["finish"], got["stop"]) == (ref["tokens"], ref["text"], "stop", stop), k


def test_resume_arguments_are_checked(decode_engine):
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = random_prompt(10, seed=79)
    for k, chars in ((10, 0), (4, 0), (2, 10_000)):  # whole prompt, >= max_tokens, more text than the tokens make
        with pytest.raises(ValueError):
            decode_engine.begin_import(f"bad-{k}-{chars}", ids, sp, resumed_tokens=k, resumed_text_chars=chars)
    assert decode_engine.allocator.num_used == 0
