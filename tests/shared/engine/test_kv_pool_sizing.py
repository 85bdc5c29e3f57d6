"""GPU KV pool sizing arithmetic (what the pool gets from the instance's share, the weights and the measured step
peak), the profile's page table, and the load-time helpers that keep temporaries small (the dummy generator's
`RandomFill`, the chunked per-channel quantizer): CPU only, numbers given."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import loader
from pdserve.engine.config import CUDA_CONTEXT_BYTES, EngineConfig, gpu_kv_pool_bytes
from pdserve.engine.kv_cache import QuantizedKVCache
from pdserve.engine.memory_profile import context_table, profile_pages, step_tokens_bound
from pdserve.engine.quant import fp8_quant
from pdserve.engine.quant.fp8_quant import FP8, FP8_MAX, quantize_weight_per_channel

GB, GiB = 10**9, 2**30
H200_TOTAL = 143_771 * 2**20  # what an H200 reports (141 GB)


def test_70b_fp8_on_one_h200_gets_the_memory_left():
    """R1-Distill-Llama-70B shape in FP8: 72.7 GB of weights (68.5 GB of e4m3 projections, the bf16 embedding and LM
    head 2.1 GB each); the pool gets 0.9 of the device less the weights, the context and the step peak: about 60 GB
    of int8 KV, ~360k tokens (the issue's expectation)."""
    weights, peak = int(72.7 * GB), int(1.5 * GiB)
    held = weights + CUDA_CONTEXT_BYTES
    free = H200_TOTAL - held  # alone on the GPU, the loader's temporaries given back
    assert EngineConfig(model_dir="m").gpu_memory_utilization == 0.9
    pool = gpu_kv_pool_bytes(H200_TOTAL, free, held, 0.9, peak)
    assert pool == int(0.9 * H200_TOTAL - held - peak)
    assert 58 * GB < pool < 62 * GB
    token = QuantizedKVCache.int8_bytes_per_page(80, 1, 8, 128, 64, False)
    assert token == 80 * 2 * 8 * (128 + 2 * 2)  # int8 g64: a byte a value + an fp16 scale per 64 values, K and V
    assert 340_000 < pool // token < 370_000
    # what the issue measured: 40 GB of freed load temporaries still reserved count twice (held and not free)
    cached = 40 * GB
    stale = gpu_kv_pool_bytes(H200_TOTAL, free - cached, held + cached, 0.85)
    assert stale < 17 * GB


def test_the_step_peak_comes_out_of_the_share_and_of_what_is_free():
    total = 80 * GiB
    # the share binds: 0.9 x 80 - 30 - 4
    assert gpu_kv_pool_bytes(total, 50 * GiB, 30 * GiB, 0.9, 4 * GiB) == int(0.9 * total - 34 * GiB)
    # what is free binds (another process holds the rest): the peak must fit there too, with a context's margin
    assert gpu_kv_pool_bytes(total, 20 * GiB, 30 * GiB, 0.9, 4 * GiB) == 16 * GiB - CUDA_CONTEXT_BYTES
    # a peak larger than what is left: no pool (the runner refuses to start)
    assert gpu_kv_pool_bytes(total, 50 * GiB, 30 * GiB, 0.5, 11 * GiB) <= 0
    # no peak given: the old arithmetic
    assert gpu_kv_pool_bytes(total, 50 * GiB, 30 * GiB, 0.9) == int(0.9 * total - 30 * GiB)


@pytest.mark.parametrize("context, chunk, ps", [(16384, 2056, 16), (100, 100, 16), (33, 7, 4), (1, 1, 16)])
def test_profile_table_cycles_over_the_temporary_pool(context, chunk, ps):
    pages = profile_pages(chunk, ps)
    table = context_table(context, chunk, ps, pages)
    assert len(table) == -(-context // ps) and max(table) < pages
    start = context - chunk
    slots = [table[p // ps] * ps + p % ps for p in range(start, context)]  # the chunk's K/V slots
    assert len(set(slots)) == chunk  # distinct: the profile's writes never overlap
    with pytest.raises(ValueError, match="distinct pages"):
        context_table(context, chunk, ps, pages - 1)


def test_random_fill_draws_rows_at_a_time_through_one_bounded_scratch(monkeypatch):
    monkeypatch.setattr(loader, "DUMMY_SCRATCH_ELEMENTS", 1000)
    fill = loader.RandomFill(torch.Generator().manual_seed(3), torch.device("cpu"))
    a = fill(torch.empty(64, 300, dtype=torch.bfloat16), 0.5)  # 3 rows (900 values) at a time
    assert fill.scratch.numel() == 900
    wide = fill(torch.empty(4, 5000), 1.0)  # a row longer than the cap: one row at a time
    assert fill.scratch.numel() == 5000 and wide.std().item() == pytest.approx(1.0, rel=0.1)
    assert a.dtype == torch.bfloat16 and a.std().item() == pytest.approx(0.5, rel=0.1)
    codes = fill(torch.empty(50, 256, dtype=FP8), 64.0, clip=FP8_MAX)
    assert codes.float().abs().max().item() <= FP8_MAX and codes.float().isfinite().all()
    again = loader.RandomFill(torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(again(torch.empty(64, 300, dtype=torch.bfloat16), 0.5), a)  # one seed, the same values
    vec = fill(torch.empty(1, 10_000), 0.1, mean=1.0)  # the norms' weights: mean 1
    assert vec.mean().item() == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_per_channel_quantizer_equals_the_whole_tensor_one(monkeypatch, dtype):
    w = (torch.randn(37, 96) * torch.rand(37, 1) * 5).to(dtype)
    w[3] = 0  # an all-zero row: the floor scale
    keep = w.clone()
    scale = w.float().abs().amax(dim=1).clamp(min=fp8_quant.AMAX_FLOOR) / FP8_MAX
    ref = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    whole_q, whole_s = quantize_weight_per_channel(w)  # searched scales, in one piece
    monkeypatch.setattr(fp8_quant, "QUANT_CHUNK_ELEMENTS", 96 * 5)  # 5 rows at a time, a partial last block
    q, s = quantize_weight_per_channel(w, search=())
    assert torch.equal(s, scale) and torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    q, s = quantize_weight_per_channel(w)
    assert torch.equal(s, whole_s) and torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8))
    assert torch.equal(w, keep)  # the input is not scaled in place (float32 input: .float() would alias it)


@pytest.mark.parametrize(
    "budget, chunk, seqs, want",
    [(0, 2048, 8, 2056), (1024, 2048, 64, 1088), (4096, 2048, 64, 2112), (-1, 512, 64, 4160), (-1, 8192, 8, 8200)],
)
def test_the_profiled_step_is_the_largest_one_the_engine_runs(budget, chunk, seqs, want):
    cfg = EngineConfig(model_dir="m", step_token_budget=budget, chunk_size=chunk, max_num_seqs=seqs)
    assert step_tokens_bound(cfg) == want
