"""KV pages out of and into tensor-parallel pools (`tp.page_export`, `tp.page_import`): the GATHER message and a STEP
plan's layer exports (round trip, malformed ones refused), the assembly of every KV head from the ranks' parts
(replicated heads too), and engines at TP=2 and TP=3 (ranks as child processes, gloo) against TP=1: pages imported
into a TP pool and exported again are bit for bit what a TP=1 pool gives, float32 and int8 (quantized per head on
each rank)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loader import parse_model_config
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tp.layout import make_layout
from pdserve.engine.tp.page_export import GATHER, LayerExport, assemble, decode_gather, gather_message
from pdserve.engine.tp.page_import import rank_parts
from pdserve.engine.tp.worker import StepPlan
from pdserve.models.checkpoints import build_checkpoint

PROMPT = [5 + (11 * j) % 500 for j in range(19)]  # 5 pages of 4: the last one partial


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    return build_checkpoint(tmp_path_factory.mktemp("tp_export") / "model", arch="llama", seed=4, **shape)


def test_gather_message_round_trip_and_malformed_refused():
    msg = gather_message([3, 1], [4, 2], True, 8, False, torch.int8, (0, 2))
    assert int(msg[0]) == GATHER
    assert decode_gather(msg, num_pages=4, page_size=4) == ([3, 1], [4, 2], True, 8, False, torch.int8, (0, 2))
    assert decode_gather(gather_message([0], [1], False, 0, False, None, None), 1, 4)[-2:] == (None, None)
    with pytest.raises(ValueError, match="outside the pool"):
        decode_gather(msg, num_pages=3, page_size=4)
    with pytest.raises(ValueError, match="token count outside the page"):
        decode_gather(msg, num_pages=4, page_size=3)
    with pytest.raises(ValueError, match="malformed GATHER message"):
        decode_gather(msg[:-1], num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="malformed GATHER format"):
        decode_gather(msg.index_fill(0, torch.tensor([8]), 99), num_pages=4, page_size=4)  # dtype code
    with pytest.raises(ValueError, match="2 pages with 1 token counts"):
        gather_message([0, 1], [4], False, 0, False, None, None)


def test_step_plan_carries_layer_exports():
    """A STEP plan names the layer groups its forward exports (a streaming prefill chunk): round trip, and a tail that
    does not add up refused like any malformed plan; a plan without exports encodes as before."""
    exports = [
        LayerExport(0, 1, [3, 4], [4, 2], True, 8, False, torch.int8),
        LayerExport(1, 2, [3, 4], [4, 2], True, 8, False, torch.int8),
    ]
    plan = StepPlan([5, 6, 7], [0], [3], [[3, 4]], 0, [2], exports)
    assert StepPlan.decode(plan.encode(), vocab_size=16, num_pages=8, page_size=4) == plan
    bare = StepPlan([5, 6, 7], [0], [3], [[3, 4]], 0, [2])
    assert plan.encode()[: len(bare.encode())].tolist() == bare.encode().tolist()
    for bad in (plan.encode()[:-1], torch.cat([plan.encode(), torch.tensor([0])])):
        with pytest.raises(ValueError, match="does not match its header"):
            StepPlan.decode(bad, vocab_size=16, num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="outside the pool"):
        StepPlan.decode(plan.encode(), vocab_size=16, num_pages=4, page_size=4)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_ranks_parts_assemble_to_every_head(model_dir, tp):
    """Split [N, 2, L, ps, KVH, d] into the ranks' heads (TP=3: [0, 0], [0, 1], [1, 1]) and back: the same tensor."""
    layout = make_layout(parse_model_config(str(model_dir)), tp)
    full = torch.randn(3, 2, 2, 4, 2, 8)
    parts = rank_parts(full, layout)
    assert all(p.shape[4] == layout.kv_per_rank for p in parts)
    assert torch.equal(assemble(layout, parts), full)
    if tp == 3:  # rank 0 holds head 0 twice: the assembly takes each head from the first rank holding it
        assert torch.equal(parts[0][..., 1, :], full[..., 0, :])


def prefill_pages(engine: LLMEngine, rid: str) -> tuple[list[int], list[int], int]:
    """Run PROMPT as a prefill-only request: (its page indexes, their token counts, the first token)."""
    engine.add_request(EngineRequest(rid, PROMPT, SamplingParams(max_tokens=4, temperature=0.0), prefill_only=True))
    pages: list[int] = []
    first = None
    while first is None:
        for o in engine.step():
            pages += o.ready_pages
            if o.finished:
                first = o.new_token_ids[0]
    tokens = [min(4, len(PROMPT) - 4 * p) for p in pages]
    return pages, tokens, first


def reexport(engine: LLMEngine, batch, layout, first: int, out_layouts) -> list[torch.Tensor]:
    """Import `batch` (pages of every head in `layout`) as a prompt, then export it in each of `out_layouts`."""
    engine.begin_import("d", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.import_batch("d", batch.page_indexes, batch.num_tokens, batch.rows, layout)
    engine.finish_import("d", first)
    return [engine.export_batch("d", batch.page_indexes, lay).rows for lay in out_layouts]


@pytest.mark.parametrize(("kv_dtype", "tp"), [("auto", 2), ("int8", 3)])
def test_pages_through_a_tp_pool_are_bit_identical_to_tp1(model_dir, kv_dtype, tp):
    """A TP=1 prefill's pages, imported into a pool and exported again as float32 and int8 (auto pool: quantized on
    each rank; int8 pool: copied out, a replicated head at TP=3): a TP pool's bytes equal a TP=1 pool's, and an auto
    pool gives back the pages it was sent."""
    torch.set_num_threads(1)
    common = dict(model_dir=str(model_dir), device="cpu", page_size=4, chunk_size=8, num_pages=32, kv_dtype=kv_dtype)
    ref = LLMEngine(EngineConfig(**{**common, "kv_dtype": "auto"}))
    pages, _, first = prefill_pages(ref, "p")
    fp32 = ref.pool_layout
    int8 = dataclasses.replace(fp32, dtype="int8", group_size=ref.kv_group_size, asymmetric=ref.kv_asymmetric)
    sent = ref.export_batch("p", pages, fp32 if kv_dtype == "auto" else int8)
    layouts = (fp32, int8)
    want = reexport(LLMEngine(EngineConfig(**common)), sent, layouts[kv_dtype != "auto"], first, layouts)
    if kv_dtype == "auto":
        assert torch.equal(want[0], sent.rows) and torch.equal(want[1], ref.export_batch("p", pages, int8).rows)
    engine = LLMEngine(EngineConfig(**common, tensor_parallel_size=tp))
    try:
        assert engine.runner.num_local_kv_heads == make_layout(engine.model_config, tp).kv_per_rank
        got = reexport(engine, sent, layouts[kv_dtype != "auto"], first, layouts)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        assert engine.runner._supervisor is not None
        engine.runner._supervisor.stop()
