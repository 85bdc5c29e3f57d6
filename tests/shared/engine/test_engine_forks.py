"""n > 1 and best_of (engine/forks.py): one prompt computed once, forks over shared pages (refcounts,
copy-on-write of the last prompt page), per-fork generators, freeing per fork, preemption, best-of ranking."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_testutil import layout_for, random_prompt
from test_engine_disagg import import_all, prefill

from pdserve.engine.forks import ChoicePlan, cumulative_logprob, fork_id
from pdserve.engine.page_table import PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidRequest

PAGE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)


def run_choices(engine, max_steps: int = 2000) -> dict[str, dict[int, dict]]:
    """Step until idle: {request_id: {index: {"tokens", "text", "finish", "outputs"}}}; checks that each request's
    last output (and only it) is `request_done`."""
    res: dict[str, dict[int, dict]] = {}
    done: set[str] = set()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return res
        for o in engine.step():
            assert o.request_id not in done, "output after the request's last one"
            c = res.setdefault(o.request_id, {}).setdefault(
                o.index, {"tokens": [], "text": "", "finish": None, "outputs": []}
            )
            c["tokens"] += o.new_token_ids
            c["text"] += o.text_delta
            c["outputs"].append(o)
            if o.finished:
                assert c["finish"] is None, "a choice finished twice"
                c["finish"] = o.finish_reason
            if o.request_done:
                done.add(o.request_id)
    raise AssertionError("engine did not finish")


def test_allocator_hold_and_refcounts():
    a = PageAllocator(6)
    x = a.allocate(3)
    a.hold(x[:2])
    assert [a.refcount(p) for p in x] == [2, 2, 1]
    a.free(x)
    assert [a.refcount(p) for p in x] == [1, 1, 0] and a.num_used == 2
    with pytest.raises(ValueError):
        a.hold([x[2]])  # nobody holds it
    a.free(x[:2])
    assert a.num_used == 0 and a.num_free == 6


def test_choice_plan_limits():
    assert ChoicePlan.of(1, 0) == ChoicePlan(1, 1) and not ChoicePlan.of(1, 0).forks
    assert ChoicePlan.of(2, 5).buffered and not ChoicePlan.of(3, 3).buffered
    for n, best_of in ((0, 0), (17, 0), (3, 2), (2, 17)):
        with pytest.raises(InvalidRequest):
            ChoicePlan.of(n, best_of)


@pytest.mark.parametrize("plen", [1, PAGE, PAGE + 1, 9])
def test_n4_greedy_identical_and_equal_to_n1(plen, make_engine):
    e = make_engine("llama", num_pages=64)
    prompt = random_prompt(plen, seed=plen)
    e.add_request(EngineRequest("one", prompt, GREEDY))
    e.add_request(EngineRequest("four", prompt, GREEDY, n=4))
    res = run_choices(e)
    ref = res["one"][0]["tokens"]
    assert len(ref) == GREEDY.max_tokens
    assert sorted(res["four"]) == [0, 1, 2, 3]
    for i in range(4):
        assert res["four"][i]["tokens"] == ref, i
        assert res["four"][i]["text"] == res["one"][0]["text"]
        assert res["four"][i]["finish"] == "length"
        assert all(o.num_prompt_tokens == plen for o in res["four"][i]["outputs"])
    assert e.allocator.num_used == 0 and not e.request_ids() and not e._groups


def test_fork_shares_full_pages_and_copies_the_last(make_engine):
    e = make_engine("llama", num_pages=64)
    prompt = random_prompt(10, seed=3)  # pages [0..3], [4..7] full; [8, 9] partial
    e.add_request(EngineRequest("r", prompt, dataclasses.replace(SAMPLED, max_tokens=4), n=3))
    while "r" not in e._groups:
        assert not e.step()  # nothing comes out before the forks computed their first tokens
    forks = [e._seqs[fork_id("r", i)] for i in range(3)]
    tables = [f.page_table for f in forks]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert [e.allocator.refcount(p) for p in shared] == [3, 3]
    lasts = [t[2] for t in tables]
    assert len(set(lasts)) == 3 and all(e.allocator.refcount(p) == 1 for p in lasts)
    assert all(f.num_computed_tokens == 9 for f in forks)
    data = e.runner.kv_cache.data  # [2, L, P, ps, kvh, d]
    for p in lasts[1:]:  # copied before any fork wrote to it
        assert torch.equal(data[:, :, p, :2], data[:, :, lasts[0], :2])
    e.step()  # every fork recomputes position 9 in its own page and samples its first token
    e.step()  # ... and writes position 10 there
    for p in lasts[1:]:
        torch.testing.assert_close(data[:, :, p, :2], data[:, :, lasts[0], :2])  # the prompt's KV, same values
    tokens = [f.completion_token_ids[0] for f in forks]
    i, j = next((i, j) for i in range(3) for j in range(i + 1, 3) if tokens[i] != tokens[j])  # seed 7 diverges
    assert not torch.equal(data[:, :, lasts[i], 2], data[:, :, lasts[j], 2])  # each wrote its own token's KV
    assert [e.allocator.refcount(p) for p in shared] == [3, 3]  # the shared pages were never written
    run_choices(e)
    assert e.allocator.num_used == 0 and not e._groups


def test_seeded_forks_are_reproducible_and_differ(make_engine):
    prompt = random_prompt(6, seed=11)
    runs = []
    for _ in range(2):
        e = make_engine("llama", num_pages=64)
        e.add_request(EngineRequest("s", prompt, SAMPLED, n=3))
        runs.append({i: c["tokens"] for i, c in run_choices(e)["s"].items()})
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0].values()}) > 1  # three generators, not one
    # fork i draws as n = 1 with seed + i does: forks 2, 3 of seed 6 are forks 1, 2 of 7
    e = make_engine("llama", num_pages=64)
    e.add_request(EngineRequest("t", prompt, dataclasses.replace(SAMPLED, seed=6), n=4))
    shifted = {i: c["tokens"] for i, c in run_choices(e)["t"].items()}
    assert shifted[2] == runs[0][1] and shifted[3] == runs[0][2]


def test_abort_frees_every_fork(make_engine):
    e = make_engine("llama", num_pages=64)
    e.add_request(EngineRequest("a", random_prompt(7, seed=5), SAMPLED, n=4))
    while "a" not in e._groups:
        e.step()
    e.step()
    e.step()
    assert e.allocator.num_used > 0
    assert e.abort("a")
    outs = e.step()
    aborted = sorted(o.index for o in outs if o.finish_reason == "abort")
    assert aborted == [0, 1, 2, 3]
    assert sum(o.request_done for o in outs) == 1 and outs[-1].request_done
    assert e.allocator.num_used == 0 and not e.request_ids() and not e._groups
    assert not e.abort("a")


def test_forks_finish_one_by_one_and_free_pages(make_engine):
    e = make_engine("llama", num_pages=64)
    prompt = random_prompt(9, seed=2)
    stops = dataclasses.replace(SAMPLED, max_tokens=12, stop_token_ids=list(range(5, 200)))  # about 40% per token
    e.add_request(EngineRequest("f", prompt, stops, n=4))
    res = run_choices(e)["f"]
    assert sorted(res) == [0, 1, 2, 3] and all(c["finish"] in ("stop", "length") for c in res.values())
    assert len({len(c["tokens"]) for c in res.values()}) > 1  # they ended at different steps
    lefts = sorted(o.choices_left for c in res.values() for o in c["outputs"] if o.finished)
    assert lefts == [0, 1, 2, 3]
    assert e.allocator.num_used == 0 and not e._groups


def test_preempted_forks_recompute_and_match(make_engine):
    prompt = random_prompt(9, seed=4)
    sp = dataclasses.replace(GREEDY, max_tokens=24)
    ref = make_engine("llama", num_pages=64).generate([prompt], sp)[0]
    e = make_engine("llama", num_pages=12)  # 3 prompt pages shared; 4 forks of 33 tokens need more than 12
    e.add_request(EngineRequest("p", prompt, sp, n=4))
    preempted = 0
    res: dict[int, list[int]] = {}
    while e.has_unfinished_requests():
        running = set(id(s) for s in e.scheduler.running)
        for o in e.step():
            res.setdefault(o.index, []).extend(o.new_token_ids)
        preempted += sum(1 for s in e.scheduler.waiting if id(s) in running)
    assert preempted > 0
    assert res == {i: ref for i in range(4)}
    assert e.allocator.num_used == 0 and not e._groups


def test_best_of_returns_the_highest_logprob_candidate(make_engine):
    prompt = random_prompt(6, seed=9)
    sp = dataclasses.replace(SAMPLED, max_tokens=6, logprobs=True)
    e = make_engine("llama", num_pages=64)
    e.add_request(EngineRequest("all", prompt, sp, n=3))
    cands = run_choices(e)["all"]
    scores = {i: sum(lp.logprob for o in c["outputs"] for lp in o.logprobs) for i, c in cands.items()}
    best = max(scores, key=lambda i: (scores[i], -i))
    e.add_request(EngineRequest("best", prompt, dataclasses.replace(sp, logprobs=False), n=1, best_of=3))
    got = run_choices(e)["best"]
    assert list(got) == [0] and got[0]["tokens"] == cands[best]["tokens"]
    (out,) = got[0]["outputs"]  # held until every candidate ended: one whole output
    assert out.request_done and out.logprobs == []  # not asked for
    e.add_request(EngineRequest("two", prompt, sp, n=2, best_of=3))
    two = run_choices(e)["two"]
    order = sorted(scores, key=lambda i: (-scores[i], i))
    assert [two[r]["tokens"] for r in (0, 1)] == [cands[i]["tokens"] for i in order[:2]]
    assert cumulative_logprob(two[0]["outputs"][0]) >= cumulative_logprob(two[1]["outputs"][0])
    assert e.allocator.num_used == 0 and not e._groups


def test_fork_validation(make_engine):
    e = make_engine("llama", num_pages=64)
    prompt = random_prompt(5, seed=1)
    for kw in (dict(n=0), dict(n=17), dict(n=3, best_of=2), dict(n=2, prefill_only=True)):
        with pytest.raises(InvalidRequest):
            e.add_request(EngineRequest("v", prompt, GREEDY, **kw))
    assert not e.request_ids()


def test_disaggregated_fork_imports_the_prompt_once(prefill_engine, decode_engine, make_engine):
    prompt = random_prompt(9, seed=8)
    local = make_engine("llama", num_pages=64)
    local.add_request(EngineRequest("c", prompt, GREEDY, n=4))
    colocated = {i: c["tokens"] for i, c in run_choices(local)["c"].items()}
    batches, first = prefill(prefill_engine, "d", prompt, GREEDY)
    assert sum(len(b.page_indexes) for b in batches) == 3  # the prompt's pages, once
    d = decode_engine
    d.begin_import("d", prompt, GREEDY, n=4)
    with pytest.raises(InvalidRequest):
        d.emit_first_token("d", first)  # forks sample their own first tokens
    import_all(d, "d", batches, layout_for(d))
    d.finish_import("d", first)
    got = {i: c["tokens"] for i, c in run_choices(d)["d"].items()}
    assert got == colocated and all(t == colocated[0] for t in got.values())
    assert d.allocator.num_used == 0 and not d._groups
