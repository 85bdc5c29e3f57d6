"""add_request(cached_pages=...): a request starts with its first N pages filled from a prompt cache."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import export_payloads, layout_for, random_prompt, run_to_completion

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.payload import PagePayload

PAGE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine("llama")


def prefill_pages(engine, prompt: list[int], kv_dtype: str = "auto") -> tuple[list[PagePayload], int]:
    """Prefill-only run of `prompt`: (payloads of its full pages, first token)."""
    engine.add_request(EngineRequest("src", prompt, GREEDY, prefill_only=True))
    first = None
    while first is None:
        for o in engine.step():
            if o.finished:
                first = o.new_token_ids[0]
    pages = export_payloads(engine, "src", list(range(len(prompt) // PAGE)), layout_for(engine, kv_dtype))
    engine.release("src")
    return pages, first


@pytest.mark.parametrize("n, n_cached", [(PAGE + 1, 1), (2 * PAGE + 3, 1), (2 * PAGE + 3, 2), (29, 7)])
def test_generate_identical_with_cached_prefix(engine, n, n_cached):
    prompt = random_prompt(n, seed=700 + n)
    ref = engine.generate([prompt], GREEDY)[0]
    pages, _ = prefill_pages(engine, prompt)
    engine.add_request(EngineRequest("c", prompt, GREEDY, cached_pages=pages[:n_cached]))
    assert engine.request_ids() == ["c"]
    assert run_to_completion(engine)["c"]["tokens"] == ref
    assert engine.allocator.num_used == 0


def test_cached_prefix_from_a_shorter_prompt(engine):
    """Pages cached by one prompt serve another that extends it (the prefix-sharing case)."""
    base = random_prompt(3 * PAGE, seed=1)
    longer = base + random_prompt(9, seed=2)
    ref = engine.generate([longer], GREEDY)[0]
    pages, _ = prefill_pages(engine, base)
    engine.add_request(EngineRequest("c", longer, GREEDY, cached_pages=pages))
    assert run_to_completion(engine)["c"]["tokens"] == ref


def test_prefill_only_ships_only_computed_pages(engine):
    prompt = random_prompt(5 * PAGE + 2, seed=3)
    pages, first_ref = prefill_pages(engine, prompt)
    engine.add_request(EngineRequest("p", prompt, GREEDY, prefill_only=True, cached_pages=pages[:3]))
    ready, first, steps = [], None, 0
    while first is None:
        steps += 1
        for o in engine.step(return_logits=True):
            ready += o.ready_pages
            if o.finished:
                first = o.new_token_ids[0]
    assert first == first_ref
    assert ready == [3, 4, 5]  # cached pages 0..2 are not reported again
    again = export_payloads(engine, "p", [0, 1, 2, 3], layout_for(engine))  # cached pages are in the pool, bit-exact
    for a, b in zip(again[:3], pages[:3]):
        assert torch.equal(a.data, b.data)
    torch.testing.assert_close(again[3].data, pages[3].data, atol=1e-5, rtol=1e-5)
    engine.release("p")
    assert engine.allocator.num_used == 0


def test_last_token_left_to_compute(engine):
    """A prompt of k full pages + 1 token may use all k pages: one token is left to compute."""
    prompt = random_prompt(3 * PAGE + 1, seed=4)
    ref = engine.generate([prompt], GREEDY)[0]
    pages, _ = prefill_pages(engine, prompt)
    engine.runner.kv_cache.data.normal_()  # the free pages still held this prompt's KV: only the import may restore it
    engine.add_request(
        EngineRequest("c", prompt, GREEDY, cached_pages=pages)
    )  # decode-ready at once: joins the decode batch
    assert run_to_completion(engine)["c"]["tokens"] == ref


def test_last_token_left_to_compute_with_overlapped_decode(make_engine):
    """The same through decode steps launched one ahead (`overlap_decode`, what a GPU engine with CUDA graphs
    runs): the decode-ready request's first step is an overlapped decode launch, which must write its cached pages
    first."""
    eng = make_engine(overlap_decode="on")
    prompt = random_prompt(3 * PAGE + 1, seed=4)
    ref = eng.generate([prompt], GREEDY)[0]
    pages, _ = prefill_pages(eng, prompt)
    eng.runner.kv_cache.data.normal_()  # the free pages still held this prompt's KV: only the import may restore it
    eng.add_request(EngineRequest("c", prompt, GREEDY, cached_pages=pages))
    assert run_to_completion(eng)["c"]["tokens"] == ref
    assert eng.allocator.num_used == 0


def test_int8_cached_pages_into_dense_pool(engine):
    """int8 pages (the decode wire format) load dequantized; the continuation stays close to the dense one."""
    prompt = random_prompt(6 * PAGE + 1, seed=5)
    dense, _ = prefill_pages(engine, prompt)
    q8, _ = prefill_pages(engine, prompt, kv_dtype="int8")
    assert all(p.data.dtype == torch.int8 for p in q8)
    rows = {}
    for rid, pages in (("dense", dense), ("int8", q8)):
        engine.add_request(
            EngineRequest(
                rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True, cached_pages=pages
            )
        )
        while rid not in rows:
            for o in engine.step(return_logits=True):
                if o.finished:
                    rows[rid] = o.logits
        engine.release(rid)
    assert rows["dense"].argmax() == rows["int8"].argmax()
    assert (rows["dense"] - rows["int8"]).abs().max() < 0.05 * rows["dense"].abs().max()
    assert engine.allocator.num_used == 0


def test_abort_before_first_step_frees_nothing_twice(engine):
    prompt = random_prompt(3 * PAGE, seed=6)
    pages, _ = prefill_pages(engine, prompt)
    engine.add_request(EngineRequest("a", prompt, GREEDY, cached_pages=pages[:2]))
    assert engine.abort("a")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert engine.allocator.num_used == 0 and not engine.has_unfinished_requests()


def test_bad_cached_pages_rejected(engine):
    prompt = random_prompt(3 * PAGE, seed=7)
    pages, _ = prefill_pages(engine, prompt)
    partial = engine_partial_page(engine, prompt)
    cases = {
        "cover all": (pages, "last token"),
        "out of order": ([pages[1], pages[0]], "page_index"),
        "partial page": ([partial], "tokens"),
        "layer range": ([PagePayload(0, PAGE, 0, pages[0].data[:, :1], None, None, 0)], "layers"),
        "shape": ([PagePayload(0, PAGE, 0, pages[0].data[..., :-1], None, None, 0)], "shape"),
    }
    for name, (bad, reason) in cases.items():
        with pytest.raises(ValueError, match=reason):
            engine.add_request(EngineRequest("bad", prompt, GREEDY, cached_pages=bad))
        assert engine.request_ids() == [], name
    assert engine.allocator.num_used == 0


def engine_partial_page(engine, prompt: list[int]) -> PagePayload:
    engine.add_request(EngineRequest("part", prompt[: PAGE - 1], GREEDY, prefill_only=True))
    while not any(o.finished for o in engine.step()):
        pass
    (p,) = export_payloads(engine, "part", [0], layout_for(engine))
    engine.release("part")
    return p


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_keep_cached_upload_is_the_exact_stored_bytes_and_is_released(engine, kv_dtype):
    """keep_cached_upload: after the import, take_cached_upload returns the prefix as stacked (the payloads' own
    format, exact), once; without the flag, or after abort, nothing is kept."""
    prompt = random_prompt(4 * PAGE + 1, seed=9)
    pages, _ = prefill_pages(engine, prompt, kv_dtype)
    engine.add_request(
        EngineRequest("u", prompt, GREEDY, prefill_only=True, cached_pages=pages, keep_cached_upload=True)
    )
    assert engine.take_cached_upload("u") is None  # not imported before its first step
    engine.add_request(EngineRequest("k", prompt, GREEDY, prefill_only=True, cached_pages=pages))
    engine.step()
    up = engine.take_cached_upload("u")
    assert up is not None and engine.take_cached_upload("u") is None
    assert torch.equal(up.data, torch.stack([p.data for p in pages]))
    if kv_dtype == "int8":
        assert torch.equal(up.scales, torch.stack([p.scales for p in pages]))
    else:
        assert up.scales is None
    assert engine.take_cached_upload("k") is None  # not asked for
    engine.add_request(
        EngineRequest("a", prompt, GREEDY, prefill_only=True, cached_pages=pages, keep_cached_upload=True)
    )
    run_to_completion(engine)
    seq = engine._seqs["a"]
    assert seq.cached_upload is not None  # kept, not taken
    engine.abort("a")
    assert engine.take_cached_upload("a") is None and seq.cached_upload is None
    for rid in ("u", "k"):
        engine.release(rid)
    assert engine.allocator.num_used == 0
