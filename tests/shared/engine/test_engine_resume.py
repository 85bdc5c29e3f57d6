"""Failover resume: a request whose instance died after k tokens continues elsewhere and produces exactly the
uninterrupted stream: same tokens (greedy and seeded sampling), same text (text held back at the cut comes out
after it), same finish reason and usage. Both modes:
- disaggregated: another pair prefills prompt + those k tokens (`sampled_before=k`) and decode imports them with
  `resumed_tokens=k` and the characters already delivered;
- colocated: an engine that prefills itself, `add_request(EngineRequest(prompt + k tokens, resumed_tokens=k,
  resumed_text_chars=c))`, re-prefills them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from engine_testutil import layout_for, random_prompt, run_to_completion

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

N = 24


@dataclass
class Mode:
    engine: LLMEngine  # runs the reference and the resumed request to completion
    start: Callable[[str, list[int], SamplingParams, int, int], None]  # (rid, prompt + k tokens, sp, k, chars)
    engines: list[LLMEngine]  # whose pools must be empty afterwards


def disaggregated(prefill_engine: LLMEngine, decode_engine: LLMEngine) -> Mode:
    def start(rid: str, ids: list[int], sp: SamplingParams, k: int, chars: int) -> None:
        prefill_engine.add_request(EngineRequest(rid, ids, sp, prefill_only=True, sampled_before=k))
        layout = layout_for(prefill_engine)
        batches, first = [], None
        while first is None:
            for o in prefill_engine.step():
                if o.ready_pages:
                    batches.append(prefill_engine.export_batch(rid, o.ready_pages, layout))
                if o.finished:
                    first = o.new_token_ids[0]
        prefill_engine.release(rid)
        decode_engine.begin_import(rid, ids, sp, resumed_tokens=k, resumed_text_chars=chars)
        for b in batches:
            decode_engine.import_batch(rid, b.page_indexes, b.num_tokens, b.rows, layout)
        decode_engine.finish_import(rid, first)

    return Mode(decode_engine, start, [prefill_engine, decode_engine])


def colocated(engine: LLMEngine) -> Mode:
    def start(rid: str, ids: list[int], sp: SamplingParams, k: int, chars: int) -> None:
        engine.add_request(EngineRequest(rid, ids, sp, resumed_tokens=k, resumed_text_chars=chars))

    return Mode(engine, start, [engine])


@pytest.fixture(params=["disaggregated", "colocated"])
def mode(request, prefill_engine, decode_engine) -> Mode:
    """Colocated mode resumes on the decode engine (any engine prefills itself)."""
    if request.param == "colocated":
        return colocated(decode_engine)
    return disaggregated(prefill_engine, decode_engine)


def uninterrupted(engine: LLMEngine, prompt: list[int], sp: SamplingParams) -> dict:
    engine.add_request(EngineRequest("ref", prompt, sp))
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


def resumed(mode: Mode, prompt: list[int], sp: SamplingParams, ref: dict, k: int) -> dict:
    """The first k tokens (and their delivered text) came from the dead instance; the rest from here."""
    done, delivered = ref["tokens"][:k], delivered_text(ref, k)
    rid = f"resume-{k}"
    mode.start(rid, prompt + done, sp, k, len(delivered))
    rest = run_to_completion(mode.engine)[rid]
    assert all(e.allocator.num_used == 0 for e in mode.engines)
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
def test_resume_continues_the_same_stream(mode, sp):
    prompt = random_prompt(13, seed=77)
    ref = uninterrupted(mode.engine, prompt, sp)
    assert len(ref["tokens"]) == N
    last = ref["outputs"][-1]
    for k in (1, 2, 5, 8, 13, N - 1):
        got = resumed(mode, prompt, sp, ref, k)
        assert got["tokens"] == ref["tokens"], k
        assert got["text"] == ref["text"], k
        assert (got["finish"], got["usage"]) == (last.finish_reason, (13, N)), k


def test_resume_with_a_stop_string_across_the_cut(mode):
    """A stop string taken from the middle of the reference text: cuts before, inside and after its first
    characters all end at the same place with the same text (text held back as a possible stop-string prefix
    was not delivered before the cut; it is delivered or dropped after it exactly as without the failure)."""
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(9, seed=78)
    full = uninterrupted(mode.engine, prompt, greedy)["text"]
    assert len(full) > 12
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop])
    ref = uninterrupted(mode.engine, prompt, sp)
    assert ref["outputs"][-1].finish_reason == "stop" and ref["text"] == full[: full.index(stop)]
    for k in range(1, len(ref["tokens"])):
        got = resumed(mode, prompt, sp, ref, k)
        assert (got["tokens"], got["text"], got["finish"], got["stop"]) == (ref["tokens"], ref["text"], "stop", stop), k


def test_resume_arguments_are_checked(decode_engine):
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = random_prompt(10, seed=79)
    for k, chars in ((10, 0), (4, 0), (2, 10_000)):  # whole prompt, >= max_tokens, more text than the tokens make
        with pytest.raises(ValueError):
            decode_engine.begin_import(f"bad-{k}-{chars}", ids, sp, resumed_tokens=k, resumed_text_chars=chars)
    assert decode_engine.allocator.num_used == 0


def test_colocated_resume_arguments_are_checked(decode_engine):
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
            decode_engine.add_request(EngineRequest(f"bad-{i}", ids, sp, **kw))
    assert decode_engine.allocator.num_used == 0 and not decode_engine.has_unfinished_requests()
