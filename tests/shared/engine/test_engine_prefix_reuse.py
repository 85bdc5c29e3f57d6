"""Prompt prefixes reused inside the KV pool (PageAllocator prefix registry, add_request(prefix_keys=...)):
a request whose prefix another request computed takes those pool pages, computes only after them, and gives
exactly the outputs (tokens, first-token logits, exported pages) of computing everything."""

from __future__ import annotations

import hashlib

import pytest
import torch
from engine_testutil import export_payloads, layout_for, random_prompt, run_to_completion

from pdserve.engine.page_table import PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidRequest

PAGE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def keys(prompt: list[int], scope: bytes = b"") -> list[bytes]:
    """Chained keys of the full pages (as pdserve.cache.keys makes them: the scope in the root)."""
    out, h = [], hashlib.sha256(b"root" + scope).digest()
    for k in range(len(prompt) // PAGE):
        h = hashlib.sha256(h + bytes(str(prompt[k * PAGE : (k + 1) * PAGE]), "ascii")).digest()
        out.append(h)
    return out


# ---- allocator ------------------------------------------------------------------------------------------
def test_registered_pages_stay_evictable_and_count_as_free():
    a = PageAllocator(6)
    x = a.allocate(3)
    for p, k in zip(x, (b"a", b"b", b"c")):
        a.register(p, k)
    a.free(x)
    assert (a.num_free, a.num_used, a.num_cached) == (6, 0, 3)
    assert a.held_prefix([b"a", b"b", b"z", b"c"]) == x[:2]
    a.share(x[:2])
    assert (a.num_free, a.num_used) == (4, 2)
    a.share(x[:1])  # a second holder of page a
    a.free(x[:1])
    assert a.num_used == 2
    got = a.allocate(4)  # 3 plain free pages, then the one evictable page (c) is evicted
    assert x[2] in got and a.held_prefix([b"a", b"b", b"c"]) == x[:2] and a.num_cached == 2
    with pytest.raises(ValueError):
        a.free(got + got[:1])
    a.free(got + x[:2])
    assert (a.num_free, a.num_used) == (6, 0)


def test_eviction_takes_the_least_recently_released_first():
    a = PageAllocator(3)
    x = a.allocate(3)
    for p, k in zip(x, (b"a", b"b", b"c")):
        a.register(p, k)
    a.free([x[1]])
    a.free([x[0]])
    a.free([x[2]])
    assert a.allocate(1) == [x[1]] and a.held_prefix([b"b"]) == []
    assert a.held_prefix([b"a"]) == [x[0]]


def test_register_rules():
    a = PageAllocator(4)
    x = a.allocate(2)
    a.register(x[0], b"k")
    a.register(x[1], b"k")  # the key names x[0] already: x[1] stays a plain page
    a.free(x)
    assert a.num_cached == 1 and a.held_prefix([b"k"]) == [x[0]]
    with pytest.raises(ValueError):
        a.register(x[1], b"j")  # not held
    with pytest.raises(ValueError):
        a.share([x[1]])  # not registered


# ---- engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine("llama", page_size=PAGE, chunk_size=8, num_pages=64)


def prefill(engine, rid: str, prompt: list[int], **kw) -> tuple[int, list[int], torch.Tensor, list, tuple]:
    """Prefill-only run: (first token, ready pages in report order, first-token logits, exported pages of the
    whole prompt, the first output's token_range)."""
    engine.add_request(EngineRequest(rid, prompt, ONE, prefill_only=True, **kw))
    ready, first, logits, first_range = [], None, None, None
    while first is None:
        for o in engine.step(return_logits=True):
            first_range = first_range or o.token_range
            ready += o.ready_pages
            if o.finished:
                first, logits = o.new_token_ids[0], o.logits
    pages = export_payloads(engine, rid, list(range(-(-len(prompt) // PAGE))), layout_for(engine, "int8"))
    engine.release(rid)
    return first, ready, logits, pages, first_range


@pytest.fixture(scope="module")
def invariant_engine(make_engine):
    return make_engine("llama", page_size=PAGE, chunk_size=8, num_pages=64, batch_invariant=True)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("n", [PAGE + 1, 3 * PAGE, 3 * PAGE + 1, 29])
def test_prefill_only_reuse_equals_computing_everything(engine, invariant_engine, n, invariant):
    """Same first token, the shared pages byte for byte; the logits and the pages computed after the prefix are
    equal within float noise (another chunking of the rows), and bit for bit under batch_invariant."""
    e = invariant_engine if invariant else engine
    prompt = random_prompt(n, seed=900 + n)
    assert e.prefix_pages_held(keys(prompt)) == 0
    ref_first, ref_ready, ref_logits, ref_pages, _ = prefill(e, "cold", prompt)  # no keys: nothing kept
    assert e.prefix_pages_held(keys(prompt)) == 0
    prefill(e, "warm-up", prompt, prefix_keys=keys(prompt))  # computes all, registers its full pages
    reusable = (n - 1) // PAGE
    assert e.prefix_pages_held(keys(prompt)) == n // PAGE
    first, ready, logits, pages, token_range = prefill(e, "hit", prompt, prefix_keys=keys(prompt))
    assert token_range[0] == reusable * PAGE  # only the tokens after the pool's prefix were computed
    assert first == ref_first
    assert sorted(ready) == sorted(ref_ready) == list(range(-(-n // PAGE)))  # the shared pages ship too
    same = [torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales) for a, b in zip(pages, ref_pages)]
    assert all(same[:reusable])
    if invariant:
        assert all(same) and torch.equal(logits, ref_logits)
    else:
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert e.allocator.num_used == 0


def test_generate_with_a_shared_prefix_and_concurrent_holders(engine):
    base = random_prompt(3 * PAGE, seed=11)
    prompts = [base + random_prompt(5, seed=20 + i) for i in range(3)]
    ref = [engine.generate([p], GREEDY)[0] for p in prompts]
    engine.add_request(EngineRequest("first", prompts[0], GREEDY, prefix_keys=keys(prompts[0])))
    run_to_completion(engine)
    for i, p in enumerate(prompts):  # all three at once hold the same three prefix pages
        engine.add_request(EngineRequest(f"r{i}", p, GREEDY, prefix_keys=keys(p)))
    out = run_to_completion(engine)
    assert [out[f"r{i}"]["tokens"] for i in range(3)] == ref
    assert engine.allocator.num_used == 0


def test_other_keys_never_share(engine):
    prompt = random_prompt(3 * PAGE + 2, seed=31)
    prefill(engine, "a", prompt, prefix_keys=keys(prompt, b"tenant-a"))
    assert engine.prefix_pages_held(keys(prompt, b"tenant-b")) == 0
    _, _, _, _, token_range = prefill(engine, "b", prompt, prefix_keys=keys(prompt, b"tenant-b"))
    assert token_range[0] == 0


def test_imported_pages_are_not_registered_and_pressure_evicts(make_engine):
    e = make_engine("llama", page_size=PAGE, chunk_size=8, num_pages=12)
    prompt = random_prompt(4 * PAGE + 1, seed=41)
    ref = e.generate([prompt], GREEDY)[0]
    _, _, _, pages, _ = prefill(e, "src", prompt)
    e.add_request(EngineRequest("imp", prompt, GREEDY, cached_pages=pages[:2], prefix_keys=keys(prompt)))
    run_to_completion(e)
    assert e.prefix_pages_held(keys(prompt)) == 0  # pages 0-1 came from a cache: not this engine's computation
    e.add_request(EngineRequest("own", prompt, GREEDY, prefix_keys=keys(prompt)))
    assert run_to_completion(e)["own"]["tokens"] == ref
    assert e.prefix_pages_held(keys(prompt)) == 4
    other = random_prompt(10 * PAGE, seed=42)  # needs 11 of 12 pages: evicts the registered ones
    assert len(e.generate([other], ONE)[0]) == 1
    assert e.prefix_pages_held(keys(prompt)) < 4 and e.allocator.num_used == 0


def test_preempted_request_reuses_and_still_matches(make_engine):
    e = make_engine("llama", page_size=PAGE, chunk_size=8, num_pages=14, max_num_seqs=4)
    base = random_prompt(2 * PAGE, seed=51)
    prompts = [base + random_prompt(3, seed=60 + i) for i in range(3)]
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [e.generate([p], long)[0] for p in prompts]
    for i, p in enumerate(prompts):
        e.add_request(EngineRequest(f"r{i}", p, long, prefix_keys=keys(p)))
    out = run_to_completion(e)  # 3 x 5 pages > 14: decode preempts, recomputes onto the shared prefix
    assert [out[f"r{i}"]["tokens"] for i in range(3)] == ref
    assert e.allocator.num_used == 0


def test_prefix_keys_checked(engine):
    prompt = random_prompt(2 * PAGE + 1, seed=71)
    with pytest.raises(InvalidRequest, match="prefix_keys"):
        engine.add_request(EngineRequest("x", prompt, ONE, prefix_keys=keys(prompt) + [b"extra"]))
    with pytest.raises(InvalidRequest, match="prefix_keys"):
        engine.add_request(
            EngineRequest("x", prompt, SamplingParams(max_tokens=1, prompt_logprobs=True), prefix_keys=keys(prompt))
        )
    assert engine.request_ids() == []
