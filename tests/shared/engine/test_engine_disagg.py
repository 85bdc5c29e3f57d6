"""Prefill-only + page export on one engine, import + decode on another == one engine doing both."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.sampling import SamplingParams
from pdserve.kv.payload import PagePayload

PAGE = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prefill(engine, rid: str, prompt: list[int], sp: SamplingParams, kv_dtype: str = "auto", **kw):
    """Run a prefill-only request, exporting pages as each step reports them. Returns (payloads, first)."""
    engine.add_request(rid, prompt, sp, prefill_only=True)
    payloads: list[PagePayload] = []
    reported: list[int] = []
    first = None
    while first is None:
        for o in engine.step():
            assert o.request_id == rid
            reported += o.ready_pages
            payloads += engine.export_pages(rid, o.ready_pages, kv_dtype, **kw)
            if o.finished:
                assert o.finish_reason == "prefill_done" and len(o.new_token_ids) == 1
                first = o.new_token_ids[0]
    assert reported == list(range(-(-len(prompt) // PAGE)))  # every page exactly once, in order
    engine.release(rid)
    assert engine.allocator.num_used == 0
    return payloads, first


def decode(engine, rid: str, prompt: list[int], sp: SamplingParams, payloads, first: int) -> list[int]:
    engine.begin_import(rid, prompt, sp)
    for p in reversed(payloads):  # arrival order does not matter
        engine.import_page(rid, p)
    engine.finish_import(rid, first)
    tokens = run_to_completion(engine)[rid]["tokens"]
    assert engine.allocator.num_used == 0
    return tokens


@pytest.mark.parametrize("n", [1, PAGE, PAGE + 1, 29])
def test_dense_transfer_continues_identically(n, prefill_engine, decode_engine):
    prompt = random_prompt(n, seed=500 + n)
    ref = decode_engine.generate([prompt], GREEDY)[0]
    payloads, first = prefill(prefill_engine, "r", prompt, GREEDY)
    assert all(p.data.dtype == torch.float32 and p.group_size == 0 for p in payloads)
    assert payloads[-1].num_tokens == (n - 1) % PAGE + 1
    assert decode(decode_engine, "r", prompt, GREEDY, payloads, first) == ref


def test_seeded_sampling_survives_disaggregation(prefill_engine, decode_engine):
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    prompt = random_prompt(11, seed=9)
    ref = decode_engine.generate([prompt], sp)[0]
    payloads, first = prefill(prefill_engine, "s", prompt, sp)
    assert decode(decode_engine, "s", prompt, sp, payloads, first) == ref


def test_concurrent_imports_and_local_requests(prefill_engine, decode_engine):
    prompts = {f"r{n}": random_prompt(n, seed=600 + n) for n in (3, 9, 17)}
    local = random_prompt(6, 1)
    refs = dict(zip(prompts, decode_engine.generate(list(prompts.values()), GREEDY)))
    ref_local = decode_engine.generate([local], GREEDY)[0]
    shipped = {rid: prefill(prefill_engine, rid, p, GREEDY) for rid, p in prompts.items()}
    d = decode_engine
    got: dict[str, list[int]] = {}

    def collect(outs):
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    d.add_request("local", local, GREEDY)
    collect(d.step())
    for rid, (payloads, first) in shipped.items():
        d.begin_import(rid, prompts[rid], GREEDY)
        for p in payloads:
            d.import_page(rid, p)
        d.finish_import(rid, first)
        collect(d.step())  # imports join one at a time while others decode
    collect(o for r in run_to_completion(d).values() for o in r["outputs"])
    assert got == {**refs, "local": ref_local}
    assert d.allocator.num_used == 0


@pytest.mark.parametrize("pool, wire", [("int8", "int8"), ("int8", "auto"), ("auto", "int8")])
def test_int8_paths_run(pool, wire, prefill_engine, make_engine):
    """int8 payloads and/or int8 pool: it runs end to end (quality is measured elsewhere)."""
    d = make_engine("llama", kv_dtype=pool, kv_group_size=8, kv_asymmetric=(pool == "int8"))
    prompt = random_prompt(13, seed=77)
    ref = d.generate([prompt], GREEDY)[0]  # int8 pool: self-prefill works too
    payloads, first = prefill(prefill_engine, "q", prompt, GREEDY, kv_dtype=wire, group_size=8, asymmetric=False)
    if wire == "int8":
        assert all(
            p.data.dtype == torch.int8 and p.scales.dtype == torch.float16 and p.group_size == 8 for p in payloads
        )
    out = decode(d, "q", prompt, GREEDY, payloads, first)
    assert len(out) == GREEDY.max_tokens
    agree = sum(a == b for a, b in zip(out, ref)) / len(ref)
    print(f"pool={pool} wire={wire}: {agree:.0%} tokens agree with the same engine's own prefill")


def test_int8_pool_export_is_copy(make_engine):
    e = make_engine("llama", kv_dtype="int8", kv_group_size=16)
    e.add_request("x", random_prompt(6, 3), GREEDY, prefill_only=True)
    run_to_completion(e)
    (a,) = e.export_pages("x", [0], "int8", group_size=16, asymmetric=False)
    (b,) = e.export_pages("x", [0], "int8", group_size=16, asymmetric=False)
    table = e._seqs["x"].page_table
    pool = e.runner.kv_cache
    assert torch.equal(a.data, pool.data[:, :, table[0], :4].cpu()) and torch.equal(a.data, b.data)
    kept = (a.data.clone(), a.scales.clone())
    pool.data[:, :, table[0]] += 1  # the physical page is reused by another request: the export must not change
    pool.scales[:, :, table[0]] *= 2
    assert torch.equal(a.data, kept[0]) and torch.equal(a.scales, kept[1])
    (dense,) = e.export_pages("x", [1], "float32")
    assert dense.data.shape == (2, 2, 2, 2, 16) and dense.data.dtype == torch.float32
    e.release("x")


def test_import_validation(decode_engine, prefill_engine):
    d = decode_engine
    prompt = random_prompt(6, seed=11)
    payloads, first = prefill(prefill_engine, "v", prompt, GREEDY)
    d.begin_import("v", prompt, GREEDY)
    p0, p1 = payloads
    bad = [
        PagePayload(5, 4, 0, p0.data, None, None),  # page index out of range
        PagePayload(1, 4, 0, p0.data, None, None),  # last page has 2 tokens, not 4
        PagePayload(0, 4, 0, p0.data[:, :, :, :1], None, None),  # wrong kv_heads
        PagePayload(0, 4, 1, p0.data, None, None),  # layers 1..2 of a 2-layer model
        PagePayload(0, 4, 0, p0.data.to(torch.int8), None, None),  # int8 without scales
    ]
    for p in bad:
        with pytest.raises(ValueError):
            d.import_page("v", p)
    d.import_page("v", p0)
    with pytest.raises(ValueError, match="not imported"):
        d.finish_import("v", first)
    with pytest.raises(ValueError, match="not importing"):
        d.import_page("nope", p0)
    # a page may come as layer ranges
    d.import_page("v", PagePayload(1, 2, 0, p1.data[:, :1].clone(), None, None))
    with pytest.raises(ValueError, match="not imported"):
        d.finish_import("v", first)
    d.import_page("v", PagePayload(1, 2, 1, p1.data[:, 1:].clone(), None, None))
    d.finish_import("v", first)
    with pytest.raises(ValueError):
        d.import_page("v", p0)  # no longer importing
    run_to_completion(d)
    assert d.allocator.num_used == 0


def test_first_token_can_finish_immediately(decode_engine):
    d = decode_engine
    eos = d.model_config.eos_token_ids[0]
    prompt = random_prompt(5, seed=12)
    payloads, first = prefill(decode_engine, "e", prompt, GREEDY)
    d.begin_import("e", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    for p in payloads:
        d.import_page("e", p)
    d.finish_import("e", eos)
    assert d.allocator.num_used == 0  # finished at once: pages freed before the next step
    outs = d.step()
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outs] == [([eos], "stop", "eos")]


@pytest.mark.parametrize("n", [1, PAGE, PAGE + 1, 29])
def test_early_first_token_continues_identically(n, prefill_engine, decode_engine):
    """The first token streamed before the pages arrive (emit_first_token), then the pages, then finish_import:
    the same tokens as one engine, the first one output at once and never twice."""
    d = decode_engine
    prompt = random_prompt(n, seed=700 + n)
    ref = d.generate([prompt], GREEDY)[0]
    payloads, first = prefill(prefill_engine, "r", prompt, GREEDY)
    d.begin_import("r", prompt, GREEDY)
    assert d.emit_first_token("r", first) is False
    (early,) = d.take_pending()
    assert early.new_token_ids == [first] and not early.finished and early.num_completion_tokens == 1
    for p in payloads:  # the pages carry the prompt only (the early token's K/V is decode's to compute)
        d.import_page("r", p)
    d.finish_import("r", first)
    assert d.take_pending() == []  # no second output of the first token
    rest = run_to_completion(d)["r"]["tokens"]
    assert [first, *rest] == ref
    assert d.allocator.num_used == 0


def test_early_first_token_validation(prefill_engine, decode_engine):
    d = decode_engine
    prompt = random_prompt(6, seed=13)
    payloads, first = prefill(prefill_engine, "v", prompt, GREEDY)
    with pytest.raises(ValueError, match="not importing"):
        d.emit_first_token("nope", first)
    d.begin_import("v", prompt, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        d.emit_first_token("v", d.model_config.vocab_size)
    d.emit_first_token("v", first)
    with pytest.raises(ValueError, match="twice"):
        d.emit_first_token("v", first)
    for p in payloads:
        d.import_page("v", p)
    with pytest.raises(ValueError, match="differs"):
        d.finish_import("v", (first + 1) % d.model_config.vocab_size)
    d.finish_import("v", first)
    run_to_completion(d)
    assert d.allocator.num_used == 0


@pytest.mark.parametrize("ending", ["eos", "max_tokens"])
def test_early_first_token_that_ends_the_request(ending, decode_engine):
    """A first token that ends the request: its output is final at once; the pages may still arrive (no second
    output, freed at finish_import), or the transfer may fail (abort frees them without an output)."""
    d = decode_engine
    eos = d.model_config.eos_token_ids[0]
    prompt = random_prompt(5, seed=12)
    payloads, first = prefill(decode_engine, "e", prompt, GREEDY)
    sp = SamplingParams(max_tokens=8, temperature=0.0) if ending == "eos" else SamplingParams(max_tokens=1)
    token = eos if ending == "eos" else first
    for rid in ("e1", "e2"):
        d.begin_import(rid, prompt, sp)
        assert d.emit_first_token(rid, token) is True
        (out,) = d.take_pending()
        assert out.finished and out.new_token_ids == [token]
        assert out.finish_reason == ("stop" if ending == "eos" else "length")
    for p in payloads:
        d.import_page("e1", p)
    d.finish_import("e1", token)
    d.abort("e2")  # its transfer failed after the early finish
    assert d.take_pending() == [] and d.step() == []
    assert d.allocator.num_used == 0
