"""Layer-group export on one engine (`EngineRequest.layer_stream`): during each chunk's forward the engine hands the
pages that chunk completes to the stream's sink, one layer group at a time, in layer order; their rows are the
bytes of the whole export of those pages (unquantized and int8). Imported group by group on another engine, the
request decodes exactly as one engine doing both; a page with layers missing keeps the request from joining."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import layout_for, random_prompt, run_to_completion

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidRequest
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.layers import LayerRange, LayerStream
from pdserve.kv.transfer.page_format import PageFormat

PAGE, CHUNK = 4, 8
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def stream_prefill(
    engine, rid: str, prompt: list[int], layout
) -> tuple[list[list[ExportedPages]], list[ExportedPages], int]:
    """A prefill-only request streaming layer groups of one layer. Returns, per step, the groups the sink took
    during its forward (each checked against the whole export of its pages after the step), those whole exports,
    and the first token."""
    groups: list[ExportedPages] = []
    stream = LayerStream(layout, 1, groups.append)
    engine.add_request(EngineRequest(rid, prompt, GREEDY, prefill_only=True, layer_stream=stream))
    steps: list[list[ExportedPages]] = []
    wholes: list[ExportedPages] = []
    first = None
    while first is None:
        groups.clear()
        for o in engine.step():
            assert engine.runner.model.layer_hook is None  # set for the forward only
            assert [g.layers for g in groups] == [LayerRange(i, i + 1) for i in range(layout.num_layers)]
            assert all(g.page_indexes == o.ready_pages for g in groups)  # the pages the step reports ready
            if o.ready_pages:
                wholes.append(engine.export_batch(rid, o.ready_pages, layout))
                whole = PageFormat(layout).unpack(wholes[-1].rows)
                for g in groups:
                    part = PageFormat(layout, 1).unpack(g.rows)
                    for w, p in zip(whole, part):
                        if w is not None:
                            assert p is not None
                            at = w[:, :, g.layers.start : g.layers.stop]
                            assert torch.equal(at.view(torch.uint8), p.view(torch.uint8))
            steps.append(list(groups))
            if o.finished:
                first = o.new_token_ids[0]
    engine.release(rid)
    assert engine.allocator.num_used == 0
    return steps, wholes, first


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("n", [3, CHUNK, 2 * CHUNK + 3])
def test_groups_stream_during_the_forward_and_decode_identically(kv_dtype, n, prefill_engine, decode_engine):
    prompt = random_prompt(n, seed=700 + n)
    layout = layout_for(prefill_engine, kv_dtype)
    steps, wholes, first = stream_prefill(prefill_engine, "g", prompt, layout)
    assert len(steps) == -(-n // CHUNK)
    pages = [p for groups in steps for p in groups[0].page_indexes]
    assert pages == list(range(-(-n // PAGE)))  # every page once, with its chunk
    decode_engine.begin_import("g", prompt, GREEDY)
    for groups in steps:
        for g in groups:
            decode_engine.import_batch("g", g.page_indexes, g.num_tokens, g.rows, layout, g.layers)
    decode_engine.finish_import("g", first)
    got = run_to_completion(decode_engine)["g"]["tokens"]
    decode_engine.begin_import("w", prompt, GREEDY)  # the same pages shipped whole, chunk by chunk
    for w in wholes:
        decode_engine.import_batch("w", w.page_indexes, w.num_tokens, w.rows, layout)
    decode_engine.finish_import("w", first)
    assert got == run_to_completion(decode_engine)["w"]["tokens"]
    if kv_dtype == "auto":
        assert got == decode_engine.generate([prompt], GREEDY)[0]  # unquantized: token-identical to one engine


def test_a_page_missing_layers_keeps_the_request_importing(prefill_engine, decode_engine):
    prompt = random_prompt(6, seed=5)
    layout = layout_for(prefill_engine)
    steps, _, first = stream_prefill(prefill_engine, "m", prompt, layout)
    decode_engine.begin_import("m", prompt, GREEDY)
    g0 = steps[0][0]
    decode_engine.import_batch("m", g0.page_indexes, g0.num_tokens, g0.rows, layout, g0.layers)
    with pytest.raises(InvalidRequest, match="imported twice"):
        decode_engine.import_batch("m", g0.page_indexes, g0.num_tokens, g0.rows, layout, g0.layers)
    with pytest.raises(InvalidRequest, match="not imported"):
        decode_engine.finish_import("m", first)  # layer 1 never landed
    decode_engine.abort("m")
    run_to_completion(decode_engine)
    assert decode_engine.allocator.num_used == 0


def test_layer_stream_is_for_prefill_only_requests(prefill_engine):
    stream = LayerStream(layout_for(prefill_engine), 1, lambda e: None)
    with pytest.raises(InvalidRequest, match="prefill_only"):
        prefill_engine.add_request(EngineRequest("x", [5, 6, 7], GREEDY, layer_stream=stream))
    assert prefill_engine.allocator.num_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_groups_on_cuda_carry_events_and_survive_the_device_to_host_copy(kv_dtype, make_engine):
    """On the GPU: each group's gather is followed by a recorded CUDA event (the sender's copy waits on it, not the
    host); copied to pinned memory after it, the group's bytes are the whole export's at those layers, and a decode
    engine fed the groups generates what it generates from the whole pages."""
    from pdserve.kv.transfer.grpc_transport import to_host

    kw = dict(device="cuda", dtype="bfloat16", num_pages=64)
    src, dst = make_engine("llama", **kw), make_engine("llama", **kw)
    prompt = random_prompt(2 * CHUNK + 3, seed=11)
    layout = layout_for(src, kv_dtype)
    steps, wholes, first = stream_prefill(src, "c", prompt, layout)
    groups = [g for step in steps for g in step]
    assert all(isinstance(g.ready, torch.cuda.Event) and g.rows.device.type == "cuda" for g in groups)
    for g in groups:
        g.rows = to_host(g).to("cuda")  # the grpc sender's copy: a side stream waiting on the group's event
    for rid, batches in (("c", groups), ("w", wholes)):
        dst.begin_import(rid, prompt, GREEDY)
        for b in batches:
            dst.import_batch(rid, b.page_indexes, b.num_tokens, b.rows, layout, b.layers)
        dst.finish_import(rid, first)
    out = run_to_completion(dst)
    assert out["c"]["tokens"] == out["w"]["tokens"]
    assert dst.allocator.num_used == 0
