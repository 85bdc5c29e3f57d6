"""`overlap_decode`: greedy decode steps launched one ahead (the next step of an unchanged batch starts before the
host processes this step's tokens) give exactly the outputs of the plain engine: tokens, text, finish reasons, at
page edges, with stop conditions, requests arriving and aborted mid-decode, a pool too small to chain, and
sampling that needs the host between steps (which does not chain). On CPU a launch computes at once, so these
check the bookkeeping; the GPU path runs the same code through the decode graphs (test_engine_gpu_engine.py)."""

from __future__ import annotations

import dataclasses

import pytest
from engine_testutil import layout_for, prefill_and_export, random_prompt, record_launches, run_to_completion

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams


def _count_launches(engine: LLMEngine) -> dict[str, int]:
    """Wrap the runner's launch_decode: counts of plain and chained launches."""
    counts = {"plain": 0, "chained": 0}
    launch = engine.runner.launch_decode

    def counted(seqs, positions, prev):
        counts["chained" if prev is not None else "plain"] += 1
        return launch(seqs, positions, prev)

    engine.runner.launch_decode = counted  # type: ignore[method-assign]
    return counts


def _summary(res: dict) -> dict:
    return {
        rid: (r["tokens"], r["text"], r["outputs"][-1].finish_reason, r["outputs"][-1].stop_reason)
        for rid, r in res.items()
    }


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for rid, prompt, sp in requests:
        engine.add_request(EngineRequest(rid, prompt, sp))
    return _summary(run_to_completion(engine))


def _requests(n: int, vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i in range(n):
        prompt = random_prompt([1, 3, 4, 5, 8, 9, 12, 17][i % 8], seed=40 + i, vocab=vocab)  # around 4-token pages
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=3 + 5 * (i % 4), temperature=0.0, ignore_eos=True)))
    return out


def test_same_outputs_as_the_plain_engine_and_steps_chain(make_engine):
    plain = make_engine()
    vocab = plain.model_config.vocab_size
    reqs = _requests(8, vocab)
    want = _run(plain, reqs)
    eng = make_engine(overlap_decode="on")
    counts = _count_launches(eng)
    assert _run(eng, reqs) == want
    assert counts["chained"] > counts["plain"] > 0  # the steady decode batch chained most of its steps
    assert eng.allocator.num_free == eng.allocator.num_pages  # every page back, the chained steps' ones too


def test_stop_conditions_one_step_late_drop_the_extra_row(make_engine):
    """A sequence that stops at step N has already been launched at N+1: that row is dropped, its page freed."""
    plain = make_engine()
    vocab = plain.model_config.vocab_size
    prompt = random_prompt(6, seed=3, vocab=vocab)
    free_run = plain.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_tok = free_run[4]
    text_run = _run(make_engine(), [("t", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])
    stop_str = text_run["t"][1][3:6] if len(text_run["t"][1]) >= 6 else None
    variants = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0),  # EOS, if the random model draws it
    ]
    if stop_str:
        variants.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_str]))
    reqs = [(f"s{i}", prompt, sp) for i, sp in enumerate(variants)]
    want = _run(make_engine(), reqs)
    eng = make_engine(overlap_decode="on")
    assert _run(eng, reqs) == want
    assert want["s0"][2] == "stop" and want["s1"][2] == "length"
    assert eng.allocator.num_free == eng.allocator.num_pages


def _staggered(engine: LLMEngine, reqs, abort_at: dict[int, str]) -> dict:
    """Add one request every 3 steps; abort the named ones at the given step numbers."""
    res: dict = {}
    pending = list(reqs)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            rid, prompt, sp = pending.pop(0)
            engine.add_request(EngineRequest(rid, prompt, sp))
        if step in abort_at:
            engine.abort(abort_at[step])
        for o in engine.step():
            r = res.setdefault(o.request_id, {"tokens": [], "text": "", "outputs": []})
            r["tokens"] += o.new_token_ids
            r["text"] += o.text_delta
            r["outputs"].append(o)
        step += 1
        assert step < 2000
    return _summary(res)


def test_requests_arriving_and_aborted_mid_decode(make_engine):
    """Arrivals drain the chain for a regular step and give the same tokens. An abort at the same step number
    finds fewer tokens delivered (they come one step later), so an aborted stream is a prefix of its full run."""
    plain = make_engine()
    reqs = _requests(6, plain.model_config.vocab_size)
    reqs = [(rid, p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)) for rid, p, _ in reqs]
    full = _staggered(plain, reqs, {})
    aborts = {7: "r1", 13: "r3"}
    eng = make_engine(overlap_decode="on")
    counts = _count_launches(eng)
    got = _staggered(eng, reqs, aborts)
    for rid in full:
        if rid in aborts.values():
            tokens, text, reason, _ = got[rid]
            assert reason == "abort"
            assert tokens == full[rid][0][: len(tokens)] and len(tokens) < len(full[rid][0])
            assert full[rid][1].startswith(text)
        else:
            assert got[rid] == full[rid]
    assert counts["chained"] > 0
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_a_pool_too_small_to_chain_falls_back_to_regular_steps(make_engine):
    """With pages for barely the batch, chaining stops where the next token needs a page nobody has; the regular
    step then preempts (recompute) as the plain engine does."""
    kw = dict(num_pages=14, max_num_seqs=4)
    plain = make_engine(**kw)
    vocab = plain.model_config.vocab_size
    reqs = [
        (
            f"p{i}",
            random_prompt(7, seed=60 + i, vocab=vocab),
            SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        )
        for i in range(4)
    ]
    want = _run(plain, reqs)
    eng = make_engine(overlap_decode="on", **kw)
    assert _run(eng, reqs) == want
    assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=6, temperature=0.8, seed=5),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=True),
    ],
    ids=["sampled", "logprobs"],
)
def test_batches_that_need_the_host_between_steps_do_not_chain(make_engine, sp):
    plain = make_engine()
    vocab = plain.model_config.vocab_size
    reqs = [("g", random_prompt(5, seed=1, vocab=vocab), SamplingParams(max_tokens=6, temperature=0.0))]
    reqs.append(("h", random_prompt(6, seed=2, vocab=vocab), dataclasses.replace(sp, max_tokens=9)))  # outlives g
    want = _run(make_engine(chunk_size=32), reqs)  # both prompts in one prefill step: they decode together
    eng = make_engine(overlap_decode="on", chunk_size=32)
    counts = _count_launches(eng)
    assert _run(eng, reqs) == want
    assert counts == {"plain": 0, "chained": 0}


def test_an_import_whose_pages_landed_holds_the_chain_once(make_engine):
    """When an import's last page lands, the next step is not chained: its finish_import (an anytime command that
    runs while the step in flight computes) joins the step after that, not one later. A late finish_import holds
    the chain once only. Tokens are the plain engine's."""
    prefill = make_engine()
    prompt, bg_prompt = random_prompt(9, seed=81), random_prompt(6, seed=82)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want, bg_want = prefill.generate([prompt], sp)[0], prefill.generate([bg_prompt], long)[0]
    first, batch = prefill_and_export(prefill, "x", prompt, sp)
    eng = make_engine(overlap_decode="on")
    launches = record_launches(eng)  # (chained, rows) of each launch
    eng.add_request(EngineRequest("bg", bg_prompt, long))
    got: dict[str, list[int]] = {"bg": [], "x": []}

    def step() -> None:
        for o in eng.step():
            got[o.request_id] += o.new_token_ids

    while not any(chained for chained, _ in launches[-2:]):
        step()  # bg decodes, its steps chained
    eng.begin_import("x", prompt, sp)
    eng.import_batch("x", batch.page_indexes, batch.num_tokens, batch.rows, layout_for(prefill))
    n = len(launches)
    step()
    assert len(launches) == n  # held: nothing chained while x's finish_import is due
    step()
    assert launches[n:] == [(False, 1)]  # x not finished yet: a plain step of bg alone...
    step()
    assert launches[-1] == (True, 1)  # ... and the chain resumes: held once only
    eng.finish_import("x", first)  # its output (the first token) comes with the next step's
    while eng.has_unfinished_requests():
        step()
    assert got == {"bg": bg_want, "x": want}


def test_the_step_after_a_landed_import_takes_it_along(make_engine):
    """Pages landed, then finish_import before the next step: the step after the held one decodes both rows."""
    prefill = make_engine()
    prompt = random_prompt(11, seed=83)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first, batch = prefill_and_export(prefill, "x", prompt, sp)
    eng = make_engine(overlap_decode="on")
    rows: list[int] = []
    launch = eng.runner.launch_decode

    def counted(seqs, positions, prev):
        rows.append(len(seqs))
        return launch(seqs, positions, prev)

    eng.runner.launch_decode = counted  # type: ignore[method-assign]
    eng.add_request(EngineRequest("bg", random_prompt(5, seed=84), SamplingParams(max_tokens=30, temperature=0.0)))
    for _ in range(4):
        eng.step()
    eng.begin_import("x", prompt, sp)
    eng.import_batch("x", batch.page_indexes, batch.num_tokens, batch.rows, layout_for(prefill))
    n = len(rows)
    eng.step()  # held (the wait a finish_import would run in)
    eng.finish_import("x", first)
    eng.step()
    assert rows[n:] == [2]  # x rides the very next launch
    out = run_to_completion(eng)
    assert out["x"]["tokens"] == prefill.generate([prompt], sp)[0][1:]


def test_landed_imports_are_forgotten_when_they_end(make_engine):
    """Without chaining (overlap off) nothing takes the landings: a finished or released import leaves none behind."""
    prefill = make_engine()
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng = make_engine()  # overlap "auto": off on CPU
    assert not eng.overlap_decode
    for rid, seed in (("done", 85), ("dropped", 86)):
        prompt = random_prompt(7, seed=seed)
        first, batch = prefill_and_export(prefill, rid, prompt, sp)
        eng.begin_import(rid, prompt, sp)
        eng.import_batch(rid, batch.page_indexes, batch.num_tokens, batch.rows, layout_for(prefill))
        if rid == "done":
            eng.finish_import(rid, first)
        else:
            eng.release(rid)
    assert eng.handoff._landed == set()  # (a leak here would grow by one id per import)
    run_to_completion(eng)
    assert eng.allocator.num_free == eng.allocator.num_pages
