"""The GPU engine (fused model path, FA3, decode CUDA graphs, int8 decode kernels) against the eager engine and
an fp32 SDPA reference (Hopper GPU with flash_attn_interface and triton only; skipped elsewhere)."""

from __future__ import annotations

import dataclasses
import queue

import pytest
import torch
from engine_testutil import forced_logits, layout_for, prefill_and_export, queued_tokens, random_prompt

from pdserve.engine import kernels
from pdserve.engine.attention import select_backend
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not kernels.HAVE_TRITON,
    reason="needs a CUDA sm90 GPU and triton",
)
KW = dict(
    device="cuda", dtype="bfloat16", attention_backend="fa3", page_size=16, chunk_size=48, num_pages=96, max_num_seqs=8
)


@pytest.fixture(scope="module", autouse=True)
def need_fa3():
    backend, reason = select_backend("auto", torch.device("cuda"), torch.bfloat16, KernelChoice())
    if backend.name != "fa3":
        pytest.skip(f"FA3 unavailable: {reason}")


def run_forced(engine, prompts, forced) -> torch.Tensor:
    """`forced_logits`, then every page must be free again."""
    logits = forced_logits(engine, prompts, forced)
    assert engine.allocator.num_used == 0
    return logits


PROMPTS = [random_prompt(n, seed=n) for n in (1, 15, 16, 17, 70, 33)]


@pytest.fixture(scope="module")
def reference(make_engine):
    """fp32 SDPA engine: greedy continuations (different lengths, so the decode batch shrinks) and logits."""
    ref = make_engine("llama_hd64", **{**KW, "attention_backend": "sdpa", "dtype": "float32"})
    forced = [
        ref.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        for p, n in zip(PROMPTS, (20, 7, 33, 12, 25, 18))
    ]
    return forced, run_forced(ref, PROMPTS, forced)


@pytest.mark.parametrize("kv", ["auto", "int8-triton", "int8-dequant", "int8-fold"])
def test_graph_decode_matches_eager_and_fp32(make_engine, reference, kv):
    forced, base = reference
    extra = {} if kv == "auto" else dict(kv_dtype="int8", int8_decode_kernel=kv.split("-")[1])
    if kv == "int8-fold":  # two scale groups per head below head_dim 128 (group 32 at 64): the fold2 kernel
        extra = dict(kv_dtype="int8", int8_decode_kernel="triton", kv_group_size=32)
    eager = make_engine("llama_hd64", **KW, **extra, cuda_graphs=False)
    graph = make_engine("llama_hd64", **KW, **extra)
    assert eager.runner.kernels.fused and eager.runner.graph_runner is None and graph.runner.graph_runner is not None
    assert graph.runner.backend.kernels.decode_config == {}  # the pool's shape picks the kernel
    le, lg = run_forced(eager, PROMPTS, forced), run_forced(graph, PROMPTS, forced)
    assert lg.isfinite().all()
    # same kernels; only GEMM shapes differ (padded graph batches), so bf16-rounding-level differences
    assert ((lg - le).norm() / le.norm()).item() < 2e-2
    sdpa_bf16 = make_engine("llama_hd64", **{**KW, "attention_backend": "sdpa"}, **extra)
    err_ref = (run_forced(sdpa_bf16, PROMPTS, forced) - base).abs().max().item()
    err = (lg - base).abs().max().item()
    print(f"{kv}: max |logit - fp32| graph {err:.3f}, unfused sdpa-bf16 {err_ref:.3f}")
    assert err <= 2 * err_ref + 0.05


@pytest.mark.parametrize("gemv", ["triton-everywhere", "cublas-everywhere"])
def test_alternative_decode_kernels_match_defaults(make_engine, reference, gemv):
    """The decode kernels the bench may pick instead of the defaults: Triton GEMVs for every projection (SwiGLU
    fused into the down GEMV) or cuBLAS for all, FA3 dense decode, no programmatic dependent launch."""
    from pdserve.engine.kernels.gemv import DEFAULT_CONFIG

    forced, base = reference
    default = make_engine("llama_hd64", **KW)
    kc = default.runner.kernels
    assert set(kc.gemv) == {"qkv", "o", "gate_up", "down"} and kc.dense_decode == "triton"
    assert kc.pdl and default.runner.backend.kernels is kc  # Hopper: the fused decode chain uses PDL
    alt = make_engine(
        "llama_hd64",
        **KW,
        gemv_plan="triton" if gemv == "triton-everywhere" else "cublas",
        pdl=False,
        dense_decode_kernel="fa3",
    )
    want = dict(DEFAULT_CONFIG) if gemv == "triton-everywhere" else None
    assert alt.runner.kernels.gemv == {n: want for n in ("qkv", "o", "gate_up", "down")} and not alt.runner.kernels.pdl
    ld, la = run_forced(default, PROMPTS, forced), run_forced(alt, PROMPTS, forced)
    assert la.isfinite().all() and ((la - ld).norm() / ld.norm()).item() < 2e-2
    # PDL alone changes no result: same kernels, same order of operations (switched on the loaded engine, as the
    # bench does, and the graphs re-captured)
    nopdl = make_engine("llama_hd64", **KW)
    nopdl.runner.set_kernels(dataclasses.replace(nopdl.cfg, pdl=False))
    assert not nopdl.runner.kernels.pdl
    assert torch.equal(run_forced(nopdl, PROMPTS, forced), ld)


def test_graph_decode_under_preemption_matches_plenty_of_pages(make_engine):
    """A tight pool preempts and re-prefills sequences mid-decode (page tables replaced): the graph runner's
    cached page-table rows must follow, so greedy outputs equal those of a roomy eager engine."""
    prompts = [random_prompt(n, seed=100 + n) for n in (30, 31, 40, 45, 20, 16)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_engine("llama_hd64", **KW, cuda_graphs=False).generate(prompts, sp)
    tight = make_engine("llama_hd64", **{**KW, "num_pages": 20}, overlap_decode="off")  # overlapped: test below
    assert tight.runner.graph_runner is not None
    out = tight.generate(prompts, sp)
    same = sum(a == b for a, b in zip(out, roomy))
    assert same >= len(prompts) - 1, (out, roomy)  # bf16: at most one near-tie flip
    assert tight.allocator.num_used == 0


def test_graph_decode_covers_the_whole_context(make_engine):
    """The graphs' page tables span the model's whole context: decoding past 512 tokens (where an engine capped at
    512 falls back to eager) replays the graph at every pure decode step and matches the eager engine."""
    prompts = [random_prompt(n, seed=n) for n in (600, 530)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = {**KW, "chunk_size": 256, "num_pages": 160}
    eager = make_engine("llama_hd64", **kw, cuda_graphs=False)
    graph = make_engine("llama_hd64", **kw)
    capped = make_engine("llama_hd64", **kw, cuda_graph_max_context=512)
    runner = graph.runner.graph_runner
    assert runner.max_context == graph.max_model_len and capped.runner.graph_runner.max_context == 512
    assert not capped.runner.graph_runner.can_run(1, 600) and runner.can_run(1, 600)
    positions: list[int] = []
    replay = runner.run
    runner.run = lambda ids, pos, tables: (positions.extend(pos), replay(ids, pos, tables))[1]
    forced = [eager.generate([p], sp)[0] for p in prompts]
    le, lg = run_forced(eager, prompts, forced), run_forced(graph, prompts, forced)
    # every pure decode step went through the graph; decode rows that rode along another prompt's chunk (a mixed
    # step) ran eagerly: at most one per prefill chunk (3 + 3 chunks of 256)
    eager_rows = sum(len(f) - 1 for f in forced) - len(positions)
    assert 0 <= eager_rows <= 6, eager_rows
    assert max(positions) >= 600 + len(forced[0]) - 2 > 512
    assert lg.isfinite().all() and ((lg - le).norm() / le.norm()).item() < 2e-2


def test_lean_int8_loop_in_the_engine(make_engine):
    """int8 KV at head_dim 128 (two scale groups per head): the lean loop (the default decode kernel for that pool,
    kernels/int8_planes_decode.py) gives the logits of dequantize-then-FA3 over the same int8 pool
    (`int8_decode_kernel` "dequant") to rounding, through the decode CUDA graphs, prompts at page and block edges."""
    prompts = [random_prompt(n, seed=300 + n) for n in (1, 16, 31, 33, 70)]
    kw = dict(KW, kv_dtype="int8")
    lean = make_engine("llama_hd128", **kw, int8_decode_kernel="triton")
    dequant = make_engine("llama_hd128", **kw, int8_decode_kernel="dequant")
    assert lean.runner.graph_runner and lean.kv_group_size == 64 and lean.model_config.head_dim == 128
    sps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 9, 33, 12, 40)]
    forced = dequant.generate(prompts, sps)
    ld, ll = run_forced(dequant, prompts, forced), run_forced(lean, prompts, forced)
    assert ll.isfinite().all() and ((ll - ld).norm() / ld.norm()).item() < 2e-2


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_overlapped_decode_gives_the_graph_engines_tokens(make_engine, kv):
    """overlap_decode: chained graph replays (inputs from the previous replay's argmax on the device) give exactly
    the tokens of the same engine without overlap, through arrivals (a regular step between chains), sequences
    stopping at different lengths (a dropped row each), and a tight pool (chains stop, the regular step preempts)."""
    prompts = [random_prompt(n, seed=200 + n) for n in (1, 15, 16, 17, 40, 33)]
    sps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 7, 33, 12, 25, 18)]
    extra = {} if kv == "auto" else dict(kv_dtype="int8")
    for pool in (96, 24):
        plain = make_engine("llama_hd64", **{**KW, "num_pages": pool}, **extra, overlap_decode="off")
        want = plain.generate(prompts, sps)
        eng = make_engine("llama_hd64", **{**KW, "num_pages": pool}, **extra, overlap_decode="on")
        runner = eng.runner.graph_runner
        assert runner is not None
        chained: list[bool] = []

        def counted(ids, pos, tables, replay=runner.run, chained=chained):
            chained.append(ids is None)
            return replay(ids, pos, tables)

        runner.run = counted
        out = eng.generate(prompts, sps)
        if pool == 96:
            assert out == want  # the same graph replays on the same inputs
        else:  # preemption re-prefills (bf16 prefill vs decode kernels): at most one near-tie flip, as above
            assert sum(a == b for a, b in zip(out, want)) >= len(prompts) - 1, (out, want)
        assert any(chained) and eng.allocator.num_used == 0


@pytest.mark.parametrize("overlap,temperature", [("on", 0.0), ("off", 0.0), ("on", 0.8)])
def test_imports_end_while_graph_steps_compute(make_engine, overlap, temperature):
    """EngineLoop on the GPU: imported requests' first tokens and import ends submitted while a decode batch runs
    through the graphs (chained launches, or plain replays; seeded sampling: the first token's skipped draw is a
    kernel queued from the caller's thread) are served during the steps' GPU waits, and every request's tokens are
    the ones the prefill engine generates alone (batch 1 there, 2 here: at most one near-tie flip in bf16, as
    above)."""
    sp = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
    long = SamplingParams(max_tokens=400, temperature=temperature, seed=12, ignore_eos=True)
    prefill = make_engine("llama_hd64", **KW, kv_dtype="int8", overlap_decode="off")
    prompts = [random_prompt(n, seed=300 + n) for n in (9, 16, 17, 30, 5, 24)]
    want = [prefill.generate([p], sp)[0] for p in prompts]
    loop = EngineLoop(make_engine("llama_hd64", **KW, kv_dtype="int8", overlap_decode=overlap))
    try:
        bg: queue.Queue = queue.Queue()
        loop.add_request(EngineRequest("bg", random_prompt(12, seed=399), long), bg.put)
        bg.get(timeout=60)  # decoding
        layout = layout_for(prefill)
        same = 0
        for i, prompt in enumerate(prompts):
            rid = f"x{i}"
            first, b = prefill_and_export(prefill, rid, prompt, sp)
            q: queue.Queue = queue.Queue()
            loop.begin_import(rid, prompt, sp, q.put).result(60)
            loop.call(lambda e, rid=rid, b=b: e.import_batch(rid, b.page_indexes, b.num_tokens, b.rows, layout))
            loop.emit_first_token(rid, first)
            loop.finish_import(rid, first)
            got = queued_tokens(q, timeout=60)
            assert len(got) == len(want[i]) == 12 and got[0] == want[i][0]
            same += got == want[i]
        assert same >= len(prompts) - 1
        if loop.ran_during_gpu_wait == 0 and overlap == "on" and temperature == 0.0:
            # known open: chained greedy steps wait for their tokens somewhere the gpu_wait hook does not cover
            # (sampled and unchained steps do go through it); the tokens are still checked above
            pytest.xfail("chained greedy steps: no host-only command ran during a GPU wait")
        assert loop.ran_during_gpu_wait > 0  # a decode step waits ~ms on the GPU: most of these land in one
        loop.abort("bg").result(60)
    finally:
        loop.stop()


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_mixed_steps_match_fp32(make_engine, reference, kv, monkeypatch):
    """Decode rows and prefill chunks of several prompts in one eager step (a step token budget of 24: decode rows
    take part of it), pure decode steps through the graphs: as close to fp32 as the unfused SDPA engine."""
    forced, base = reference
    extra = {} if kv == "auto" else dict(kv_dtype="int8")
    eng = make_engine("llama_hd64", **KW, **extra, step_token_budget=24)
    real, mixed = eng.scheduler.schedule, []

    def schedule():
        batch = real()
        if batch is not None and 0 < batch.num_decode < len(batch.seqs):
            mixed.append(batch.num_decode)
        return batch

    monkeypatch.setattr(eng.scheduler, "schedule", schedule)
    logits = run_forced(eng, PROMPTS, forced)
    assert mixed and max(mixed) > 1, "decode rows should share steps with prefill chunks"
    sdpa_bf16 = make_engine("llama_hd64", **{**KW, "attention_backend": "sdpa"}, **extra)
    err_ref = (run_forced(sdpa_bf16, PROMPTS, forced) - base).abs().max().item()
    err = (logits - base).abs().max().item()
    print(f"mixed {kv}: max |logit - fp32| {err:.3f}, unfused sdpa-bf16 {err_ref:.3f}")
    assert err <= 2 * err_ref + 0.05
