"""The engine / model-runner seam: the engine keeps integers (sequences hold no tensors), the runner owns tensors
and per-request generators; GPU knobs come from EngineConfig; the model has one module tree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_testutil import layout_for, random_prompt

from pdserve.engine.config import EngineConfig
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidRequest


def _tensors_in(obj) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor) or isinstance(getattr(obj, f.name), torch.Generator)
    ]


def test_sequences_hold_no_tensors_while_importing_and_running(llama_engine):
    e = llama_engine
    e.begin_import("imp", random_prompt(8, seed=1), SamplingParams(max_tokens=3, temperature=0.8, seed=3))
    e.add_request(EngineRequest("run", random_prompt(9, seed=2), SamplingParams(max_tokens=3, temperature=0.8)))
    e.step()
    for seq in e._seqs.values():
        assert _tensors_in(seq) == []
    assert e._seqs["imp"].pages_imported == [False, False]  # one flag per page, nothing received yet
    e.release("imp")
    e.release("run")
    assert e.allocator.num_used == 0


def test_import_bookkeeping_counts_pages(make_engine):
    """Pages may arrive in any order and batches, each once; finish_import needs every page."""
    src = make_engine("llama")
    dst = make_engine("llama")
    prompt = random_prompt(8, seed=4)  # page_size 4: pages 0 and 1
    src.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True))
    first = None
    while src.has_unfinished_requests():
        for o in src.step():
            first = o.new_token_ids[0] if o.new_token_ids else first
    layout = layout_for(src)
    b0, b1 = (src.export_batch("p", [i], layout) for i in (0, 1))
    dst.begin_import("p", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(InvalidRequest, match=r"pages \[0, 1\] not imported"):
        dst.finish_import("p", first)
    dst.import_batch("p", b1.page_indexes, b1.num_tokens, b1.rows, layout)  # page 1 first
    with pytest.raises(InvalidRequest, match=r"pages \[0\] not imported"):
        dst.finish_import("p", first)
    with pytest.raises(InvalidRequest, match="imported twice"):
        dst.import_batch("p", b1.page_indexes, b1.num_tokens, b1.rows, layout)
    dst.import_batch("p", b0.page_indexes, b0.num_tokens, b0.rows, layout)
    dst.finish_import("p", first)
    assert dst._seqs["p"].pages_imported is None


def test_runner_keeps_generators_of_sampled_requests_only(make_engine):
    e = make_engine("llama")
    r = e.runner
    e.add_request(EngineRequest("greedy", random_prompt(5, seed=5), SamplingParams(max_tokens=2, temperature=0.0)))
    e.add_request(EngineRequest("sampled", random_prompt(5, seed=6), SamplingParams(max_tokens=2, temperature=1.0)))
    assert set(r._generators) == {"sampled"}
    with pytest.raises(InvalidRequest):  # a rejected request leaves no generator behind
        e.add_request(
            EngineRequest(
                "bad", random_prompt(5, seed=7), SamplingParams(max_tokens=2, temperature=1.0), sampled_before=99
            )
        )
    assert set(r._generators) == {"sampled"}
    e.abort("sampled")
    e.release("greedy")
    assert r._generators == {}


def test_seed_stream_does_not_depend_on_greedy_requests(make_engine):
    """Unseeded requests draw their seeds from the engine seed in arrival order, greedy ones included."""
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    p1, p2 = random_prompt(7, seed=8), random_prompt(7, seed=9)
    a = make_engine("llama").generate([p1, p2], [greedy, sampled])[1]
    b = make_engine("llama").generate([p1, p2], [greedy, sampled])[1]
    c = make_engine("llama").generate([p1, p2], [sampled, sampled])[1]
    assert a == b and a == c


def test_model_has_one_module_tree_with_concatenated_projections(llama_engine):
    model = llama_engine.runner.model
    names = {n for n, _ in model.named_parameters()}
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in names)
    assert any(n.endswith("mlp.gate_up_proj.weight") for n in names)
    assert not any(f".{p}." in n for n in names for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    kc = llama_engine.runner.kernels
    assert not kc.fused and not kc.triton_kv_quant and kc.gemv == {}  # CPU: plain torch ops
    assert all(m.kernels is kc for m in model.modules() if hasattr(m, "kernels"))


def test_cpu_kernel_choice_ignores_gpu_knobs(checkpoint):
    cfg = EngineConfig(model_dir=str(checkpoint("llama")), device="cpu", gemv_plan="triton", pdl=True)
    from pdserve.engine.loader import parse_model_config

    kc = KernelChoice.select(cfg, torch.device("cpu"), parse_model_config(cfg.model_dir))
    assert not kc.fused and not kc.pdl and kc.gemv == {}


@pytest.mark.parametrize(
    "bad",
    [
        dict(gemv_plan="fast"),
        dict(gemv_plan='{"qkv": 3}'),
        dict(gemv_plan='{"x": null}'),
        dict(decode_kernel_config="[1]"),
        dict(decode_kernel_config="{"),
        dict(dense_decode_kernel="x"),
        dict(dense_prefill_kernel="x"),
        dict(fa3_num_splits=-1),
    ],
)
def test_gpu_knobs_are_validated(bad):
    with pytest.raises(ValueError):
        EngineConfig(model_dir="x", **bad).validate()


def test_gpu_knobs_parse():
    cfg = EngineConfig(
        model_dir="x", gemv_plan='{"qkv": {"block_n": 8}, "down": null}', decode_kernel_config='{"block_n": 32}'
    )
    cfg.validate()
    assert cfg.gemv_projections() == {"qkv": {"block_n": 8}, "down": None}
    assert cfg.decode_kernel_overrides() == {"block_n": 32}


def test_engine_options_reach_engine_config():
    """Every GPU knob of EngineConfig is an engine service's flag of the same name (so the CLI and env reach it)."""
    import argparse

    from pdserve.config import add_dataclass_args, config_from
    from pdserve.decode.config import DecodeConfig

    given = dict(
        pdl=False,
        triton=False,
        gemv_plan="cublas",
        fa3_num_splits=2,
        dense_decode_kernel="fa3",
        decode_kernel_config='{"block_n": 16}',
        cuda_graphs=False,
    )
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, DecodeConfig)
    argv = ["--model", "m", *[a for k, v in given.items() for a in ("--" + k.replace("_", "-"), str(v))]]
    cfg = config_from(DecodeConfig, parser.parse_args(argv), "PDSERVE_TEST_UNUSED_", environ={}).engine
    defaults = EngineConfig(model_dir="m")
    for name in (
        "pdl",
        "triton",
        "gemv_plan",
        "fa3_num_splits",
        "dense_decode_kernel",
        "decode_kernel_config",
        "cuda_graphs",
        "int8_decode_kernel",
        "dense_prefill_kernel",
        "cuda_graph_max_context",
        "gpu_memory_utilization",
    ):
        assert getattr(cfg, name) == given.get(name, getattr(defaults, name)), name
    assert cfg.kv_dtype == "int8" and cfg.model_dir == "m"
