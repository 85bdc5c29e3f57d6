"""What the router's failover of an n > 1 request (pdserve.router.choice_resume) relies on in the engine: choice i
of a seeded request is the request of n = 1 with seed + i, colocated and disaggregated alike, so a choice resumes
as that request (prompt + its tokens, `resumed_tokens`) and continues exactly; and best_of > n tells the completion
tokens of the candidates it did not return (usage counts them, as OpenAI's)."""

from __future__ import annotations

import dataclasses

from engine_testutil import layout_for, random_prompt
from test_engine_disagg import import_all, prefill
from test_engine_forks import SAMPLED, run_choices

from pdserve.engine.request import EngineRequest


def test_seeded_choice_i_is_the_n1_request_with_seed_plus_i(make_engine, prefill_engine, decode_engine):
    prompt = random_prompt(9, seed=21)
    e = make_engine("llama", num_pages=64)
    e.add_request(EngineRequest("n3", prompt, SAMPLED, n=3))
    forks = {i: c["tokens"] for i, c in run_choices(e)["n3"].items()}
    assert len({tuple(t) for t in forks.values()}) == 3  # three generators
    for i in range(3):
        e.add_request(EngineRequest(f"one{i}", prompt, dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i)))
        assert run_choices(e)[f"one{i}"][0]["tokens"] == forks[i], i
    batches, first = prefill(prefill_engine, "d", prompt, SAMPLED)  # prefill drew its first token from the seed
    d = decode_engine
    d.begin_import("d", prompt, SAMPLED, n=3)
    import_all(d, "d", batches, layout_for(d))
    d.finish_import("d", first)
    assert {i: c["tokens"] for i, c in run_choices(d)["d"].items()} == forks
    assert d.allocator.num_used == 0


def test_each_choice_resumes_as_an_n1_request(make_engine):
    prompt = random_prompt(7, seed=22)
    e = make_engine("llama", num_pages=64)
    e.add_request(EngineRequest("n3", prompt, SAMPLED, n=3))
    whole = run_choices(e)["n3"]
    for i, k in ((0, 4), (1, 1), (2, 9)):  # a choice cut anywhere (max_tokens 10)
        sp = dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i)
        tokens = whole[i]["tokens"]
        e.add_request(EngineRequest(f"r{i}", prompt + tokens[:k], sp, resumed_tokens=k))
        rest = run_choices(e)[f"r{i}"][0]
        assert rest["tokens"] == tokens[k:], i
        assert rest["outputs"][-1].num_completion_tokens == len(tokens)  # the resumed tokens count as completion
    assert e.allocator.num_used == 0


def test_best_of_counts_the_unreturned_candidates_tokens(make_engine):
    prompt = random_prompt(8, seed=23)
    stops = dataclasses.replace(SAMPLED, max_tokens=12, stop_token_ids=list(range(5, 200)), logprobs=True)
    e = make_engine("llama", num_pages=64)
    e.add_request(EngineRequest("all", prompt, stops, n=4))
    cands = run_choices(e)["all"]
    lengths = [len(cands[i]["tokens"]) for i in range(4)]
    assert len(set(lengths)) > 1  # candidates of different lengths: which are returned matters
    for n in (1, 2):
        e.add_request(EngineRequest(f"b{n}", prompt, stops, n=n, best_of=4))
        got = run_choices(e)[f"b{n}"]
        outs = [o for c in got.values() for o in c["outputs"]]
        last = next(o for o in outs if o.request_done)
        returned = sum(len(got[r]["tokens"]) for r in range(n))
        assert last.unreturned_tokens == sum(lengths) - returned, n
        assert all(o.unreturned_tokens == 0 for o in outs if o is not last)
    assert e.allocator.num_used == 0
