"""Prefill-only + batch export on one engine, batch import + decode on another == one engine doing both."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_testutil import layout_for, random_prompt, run_to_completion

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.page_format import PageFormat

PAGE = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prefill(
    engine, rid: str, prompt: list[int], sp: SamplingParams, layout: KVLayoutSpec | None = None
) -> tuple[list[ExportedPages], int]:
    """Run a prefill-only request, exporting pages (in `layout`, default the model dtype) as each step reports
    them. Returns (one batch per step that reported pages, first token)."""
    layout = layout or layout_for(engine)
    engine.add_request(EngineRequest(rid, prompt, sp, prefill_only=True))
    batches: list[ExportedPages] = []
    reported: list[int] = []
    first = None
    while first is None:
        for o in engine.step():
            assert o.request_id == rid
            reported += o.ready_pages
            if o.ready_pages:
                batches.append(engine.export_batch(rid, o.ready_pages, layout))
            if o.finished:
                assert o.finish_reason == "prefill_done" and len(o.new_token_ids) == 1
                first = o.new_token_ids[0]
    assert reported == list(range(-(-len(prompt) // PAGE)))  # every page exactly once, in order
    engine.release(rid)
    assert engine.allocator.num_used == 0
    return batches, first


def import_all(engine, rid: str, batches: list[ExportedPages], layout: KVLayoutSpec) -> None:
    for b in batches:
        engine.import_batch(rid, b.page_indexes, b.num_tokens, b.rows, layout)


def decode(engine, rid: str, prompt: list[int], sp: SamplingParams, batches, first: int, layout=None) -> list[int]:
    engine.begin_import(rid, prompt, sp)
    import_all(engine, rid, list(reversed(batches)), layout or layout_for(engine))  # arrival order does not matter
    engine.finish_import(rid, first)
    tokens = run_to_completion(engine)[rid]["tokens"]
    assert engine.allocator.num_used == 0
    return tokens


@pytest.mark.parametrize("n", [1, PAGE, PAGE + 1, 29])
def test_dense_transfer_continues_identically(n, prefill_engine, decode_engine):
    prompt = random_prompt(n, seed=500 + n)
    ref = decode_engine.generate([prompt], GREEDY)[0]
    layout = layout_for(prefill_engine)
    batches, first = prefill(prefill_engine, "r", prompt, GREEDY)
    assert layout.dtype == "float32" and layout.group_size == 0
    assert all(PageFormat(layout).unpack(b.rows)[0].dtype == torch.float32 for b in batches)
    assert batches[-1].num_tokens[-1] == (n - 1) % PAGE + 1
    assert decode(decode_engine, "r", prompt, GREEDY, batches, first) == ref


def test_seeded_sampling_survives_disaggregation(prefill_engine, decode_engine):
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    prompt = random_prompt(11, seed=9)
    ref = decode_engine.generate([prompt], sp)[0]
    batches, first = prefill(prefill_engine, "s", prompt, sp)
    assert decode(decode_engine, "s", prompt, sp, batches, first) == ref


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

    d.add_request(EngineRequest("local", local, GREEDY))
    collect(d.step())
    for rid, (batches, first) in shipped.items():
        d.begin_import(rid, prompts[rid], GREEDY)
        import_all(d, rid, batches, layout_for(d))
        d.finish_import(rid, first)
        collect(d.step())  # imports join one at a time while others decode
    collect(o for r in run_to_completion(d).values() for o in r["outputs"])
    assert got == {**refs, "local": ref_local}
    assert d.allocator.num_used == 0


@pytest.mark.parametrize("pool, wire", [("int8", "int8"), ("int8", "auto"), ("auto", "int8")])
def test_int8_paths_run(pool, wire, prefill_engine, make_engine):
    """int8 batches and/or int8 pool: it runs end to end (quality is measured elsewhere)."""
    d = make_engine("llama", kv_dtype=pool, kv_group_size=8, kv_asymmetric=(pool == "int8"))
    prompt = random_prompt(13, seed=77)
    ref = d.generate([prompt], GREEDY)[0]  # int8 pool: self-prefill works too
    layout = layout_for(prefill_engine, wire, group_size=8, asymmetric=False)
    batches, first = prefill(prefill_engine, "q", prompt, GREEDY, layout)
    if wire == "int8":
        unpacked = [PageFormat(layout).unpack(b.rows) for b in batches]
        assert layout.group_size == 8
        assert all(data.dtype == torch.int8 and scales.dtype == torch.float16 for data, scales, _ in unpacked)
    out = decode(d, "q", prompt, GREEDY, batches, first, layout)
    assert len(out) == GREEDY.max_tokens
    agree = sum(a == b for a, b in zip(out, ref)) / len(ref)
    print(f"pool={pool} wire={wire}: {agree:.0%} tokens agree with the same engine's own prefill")


def test_int8_pool_export_is_copy(make_engine):
    e = make_engine("llama", kv_dtype="int8", kv_group_size=16)
    e.add_request(EngineRequest("x", random_prompt(6, 3), GREEDY, prefill_only=True))
    run_to_completion(e)
    layout = layout_for(e, "int8", group_size=16, asymmetric=False)
    a = e.export_batch("x", [0], layout)
    b = e.export_batch("x", [0], layout)
    table = e._seqs["x"].page_table
    pool = e.runner.kv_cache
    a_data, a_scales, _ = PageFormat(layout).unpack(a.rows)
    assert torch.equal(a_data[0], pool.data[:, :, table[0], :4].cpu()) and torch.equal(a.rows, b.rows)
    kept = a.rows.clone()
    pool.data[:, :, table[0]] += 1  # the physical page is reused by another request: the export must not change
    pool.scales[:, :, table[0]] *= 2
    assert torch.equal(a.rows, kept)
    dense_layout = layout_for(e, "float32")
    dense = e.export_batch("x", [1], dense_layout)
    data, scales, _ = PageFormat(dense_layout).unpack(dense.rows)
    assert dense.num_tokens == [2] and data.shape == (1, 2, 2, PAGE, 2, 16) and data.dtype == torch.float32
    assert scales is None and not data[0, :, :, 2:].any()  # tokens past the page's end are zero
    e.release("x")


def test_import_validation(decode_engine, prefill_engine):
    d = decode_engine
    prompt = random_prompt(6, seed=11)
    layout = layout_for(prefill_engine)
    (both,), first = prefill(prefill_engine, "v", prompt, GREEDY)  # one chunk: pages 0 and 1 (2 tokens)
    assert both.page_indexes == [0, 1] and both.num_tokens == [4, 2]
    b0, b1 = (ExportedPages([i], both.num_tokens[i : i + 1], both.rows[i : i + 1]) for i in (0, 1))
    d.begin_import("v", prompt, GREEDY)

    def zero_rows(lay: KVLayoutSpec):
        return torch.zeros(1, PageFormat(lay).page_bytes, dtype=torch.uint8)

    narrow = dataclasses.replace(layout, num_kv_heads=1)
    shallow = dataclasses.replace(layout, num_layers=1)
    bad = [
        ([5], [4], b0.rows, layout),  # page index out of range
        ([1], [4], b0.rows, layout),  # last page has 2 tokens, not 4
        ([0], [4], zero_rows(narrow), narrow),  # wrong kv_heads
        ([0], [4], zero_rows(shallow), shallow),  # one layer of a 2-layer model
        ([0], [4], b0.rows[:, :-1], layout),  # rows that do not fit the layout
        ([0], [4], b0.rows, dataclasses.replace(layout, dtype="int8", group_size=16)),  # dense bytes read as int8
    ]
    for indexes, tokens, rows, lay in bad:
        with pytest.raises(ValueError):
            d.import_batch("v", indexes, tokens, rows, lay)
    d.import_batch("v", b0.page_indexes, b0.num_tokens, b0.rows, layout)
    with pytest.raises(ValueError, match="not imported"):
        d.finish_import("v", first)
    with pytest.raises(ValueError, match="not importing"):
        d.import_batch("nope", b0.page_indexes, b0.num_tokens, b0.rows, layout)
    with pytest.raises(ValueError, match="twice"):
        d.import_batch("v", b0.page_indexes, b0.num_tokens, b0.rows, layout)
    d.import_batch("v", b1.page_indexes, b1.num_tokens, b1.rows, layout)
    d.finish_import("v", first)
    with pytest.raises(ValueError):
        d.import_batch("v", b0.page_indexes, b0.num_tokens, b0.rows, layout)  # no longer importing
    run_to_completion(d)
    assert d.allocator.num_used == 0


def test_first_token_can_finish_immediately(decode_engine):
    d = decode_engine
    eos = d.model_config.eos_token_ids[0]
    prompt = random_prompt(5, seed=12)
    batches, first = prefill(decode_engine, "e", prompt, GREEDY)
    d.begin_import("e", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    import_all(d, "e", batches, layout_for(d))
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
    batches, first = prefill(prefill_engine, "r", prompt, GREEDY)
    d.begin_import("r", prompt, GREEDY)
    assert d.emit_first_token("r", first) is False
    (early,) = d.take_pending()
    assert early.new_token_ids == [first] and not early.finished and early.num_completion_tokens == 1
    import_all(d, "r", batches, layout_for(d))  # the prompt only (the early token's K/V is decode's to compute)
    d.finish_import("r", first)
    assert d.take_pending() == []  # no second output of the first token
    rest = run_to_completion(d)["r"]["tokens"]
    assert [first, *rest] == ref
    assert d.allocator.num_used == 0


def test_early_first_token_validation(prefill_engine, decode_engine):
    d = decode_engine
    prompt = random_prompt(6, seed=13)
    batches, first = prefill(prefill_engine, "v", prompt, GREEDY)
    with pytest.raises(ValueError, match="not importing"):
        d.emit_first_token("nope", first)
    d.begin_import("v", prompt, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        d.emit_first_token("v", d.model_config.vocab_size)
    d.emit_first_token("v", first)
    with pytest.raises(ValueError, match="twice"):
        d.emit_first_token("v", first)
    import_all(d, "v", batches, layout_for(d))
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
    batches, first = prefill(decode_engine, "e", prompt, GREEDY)
    sp = SamplingParams(max_tokens=8, temperature=0.0) if ending == "eos" else SamplingParams(max_tokens=1)
    token = eos if ending == "eos" else first
    for rid in ("e1", "e2"):
        d.begin_import(rid, prompt, sp)
        assert d.emit_first_token(rid, token) is True
        (out,) = d.take_pending()
        assert out.finished and out.new_token_ids == [token]
        assert out.finish_reason == ("stop" if ending == "eos" else "length")
    import_all(d, "e1", batches, layout_for(d))
    d.finish_import("e1", token)
    d.abort("e2")  # its transfer failed after the early finish
    assert d.take_pending() == [] and d.step() == []
    assert d.allocator.num_used == 0
