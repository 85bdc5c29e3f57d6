"""FlashAttention-3 backend vs the SDPA backend (Hopper GPU with flash_attn_interface only; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import forced_logits, random_prompt

from pdserve.engine.attention import AttentionMetadata, FA3Backend, SdpaBackend, select_backend
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.kv_cache import Int8KVCache, KVCache
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a CUDA sm90 GPU"
)


@pytest.fixture(scope="module")
def fa3() -> FA3Backend:
    backend, reason = select_backend("auto", torch.device("cuda"), torch.bfloat16, KernelChoice())
    if backend.name != "fa3":
        pytest.skip(f"FA3 unavailable: {reason}")
    return backend


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("int8", [False, True])
def test_fa3_matches_sdpa_on_paged_pool(fa3, head_dim, int8):
    dev, dt, ps, H, KVH = torch.device("cuda"), torch.bfloat16, 16, 8, 2
    g = torch.Generator(device=dev).manual_seed(0)
    pool = (
        Int8KVCache(1, 64, ps, KVH, head_dim, dt, dev, 64, False)
        if int8
        else KVCache(1, 64, ps, KVH, head_dim, dt, dev)
    )
    perm = torch.randperm(64, generator=g, device=dev).tolist()
    # prefill chunks (mixed starts/lengths), then a decode batch over the same sequences
    for starts, q_lens in (([0, 0, 0], [37, 1, 16]), ([37, 1, 16], [20, 5, 33]), ([57, 6, 49], [1, 1, 1])):
        tables = [perm[0:8], perm[8:16], perm[16:24]]
        meta = AttentionMetadata(starts, q_lens, tables, ps, dev)
        T = sum(q_lens)
        q = torch.randn(T, H, head_dim, device=dev, dtype=dt, generator=g)
        k = torch.randn(T, KVH, head_dim, device=dev, dtype=dt, generator=g)
        v = torch.randn(T, KVH, head_dim, device=dev, dtype=dt, generator=g)
        pool.write(0, meta.slot_mapping, k, v)
        ref = SdpaBackend().attend(0, q, meta, pool, head_dim**-0.5)
        out = fa3.attend(0, q, AttentionMetadata(starts, q_lens, tables, ps, dev), pool, head_dim**-0.5)
        assert out.shape == ref.shape
        assert (out.float() - ref.float()).abs().max().item() < 2e-2, (starts, q_lens)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("int8", [False, True])
def test_fa3_mixed_step_matches_sdpa(fa3, head_dim, int8):
    """A mixed step (decode rows first, then prefill chunks): the decode rows through the decode kernels (int8:
    the Triton kernel reading int8 pages), the chunks through the prefill path; the SDPA backend's output."""
    dev, dt, ps, H, KVH = torch.device("cuda"), torch.bfloat16, 16, 8, 2
    g = torch.Generator(device=dev).manual_seed(1)
    pool = (
        Int8KVCache(1, 64, ps, KVH, head_dim, dt, dev, 64, False)
        if int8
        else KVCache(1, 64, ps, KVH, head_dim, dt, dev)
    )
    perm = torch.randperm(64, generator=g, device=dev).tolist()
    tables = [perm[0:8], perm[8:16], perm[16:24], perm[24:32]]
    full = AttentionMetadata([0, 0, 0, 0], [120, 45, 30, 1], tables, ps, dev)  # earlier steps' K/V
    kv = [torch.randn(sum(full.q_lens), KVH, head_dim, device=dev, dtype=dt, generator=g) for _ in range(2)]
    pool.write(0, full.slot_mapping, *kv)
    starts, q_lens = [120, 45, 30, 1], [1, 1, 37, 50]
    T = sum(q_lens)
    q = torch.randn(T, H, head_dim, device=dev, dtype=dt, generator=g)
    k, v = (torch.randn(T, KVH, head_dim, device=dev, dtype=dt, generator=g) for _ in range(2))
    meta = AttentionMetadata(starts, q_lens, tables, ps, dev, num_decode=2)
    pool.write(0, meta.slot_mapping, k, v)
    ref = SdpaBackend().attend(0, q, AttentionMetadata(starts, q_lens, tables, ps, dev), pool, head_dim**-0.5)
    out = fa3.attend(0, q, meta, pool, head_dim**-0.5)
    assert out.shape == ref.shape
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("kernels", [KernelChoice(), KernelChoice(dense_decode="fa3", dense_prefill="gather",
                                                                  int8_decode="dequant")])  # fmt: skip
def test_fa3_op_called_directly_equals_the_interface(fa3, int8, kernels):
    """pdserve.engine.fa3_call: the op called as registered gives bit for bit what flash_attn_interface's
    functions give (varlen prefill over a dequantized scratch, paged prefill, decode), and it is what runs."""
    from pdserve.engine.fa3_call import FA3Forward

    dev, dt, ps, H, KVH, D = torch.device("cuda"), torch.bfloat16, 16, 8, 2, 128
    g = torch.Generator(device=dev).manual_seed(2)
    pool = Int8KVCache(1, 64, ps, KVH, D, dt, dev, 64, False) if int8 else KVCache(1, 64, ps, KVH, D, dt, dev)
    direct = FA3Backend(fa3.fa.module, kernels)
    via_interface = FA3Backend(fa3.fa.module, kernels)
    via_interface.fa = FA3Forward(fa3.fa.module, direct=False)
    assert direct.fa.direct and not via_interface.fa.direct
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    for starts, q_lens in (([0, 0, 0], [37, 1, 16]), ([37, 1, 16], [20, 5, 33]), ([57, 6, 49], [1, 1, 1])):
        meta = AttentionMetadata(starts, q_lens, tables, ps, dev)
        T = sum(q_lens)
        q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
        k, v = (torch.randn(T, KVH, D, device=dev, dtype=dt, generator=g) for _ in range(2))
        pool.write(0, meta.slot_mapping, k, v)
        want = via_interface.attend(0, q, meta, pool, D**-0.5)
        got = direct.attend(0, q, AttentionMetadata(starts, q_lens, tables, ps, dev), pool, D**-0.5)
        assert torch.equal(got, want), (starts, q_lens)


def test_fa3_engine_matches_sdpa_engine(make_engine):
    """Same token stream through three engines; FA3-bf16 must be as close to SDPA-fp32 as SDPA-bf16 is."""
    kw = dict(device="cuda", page_size=16, chunk_size=32, num_pages=64)
    ref = make_engine("llama_hd64", attention_backend="sdpa", dtype="float32", **kw)
    sd = make_engine("llama_hd64", attention_backend="sdpa", dtype="bfloat16", **kw)
    fa = make_engine("llama_hd64", attention_backend="fa3", dtype="bfloat16", **kw)
    assert fa.runner.backend.name == "fa3" and sd.runner.backend.name == "sdpa"
    prompts = [random_prompt(n, seed=n) for n in (1, 15, 16, 17, 70)]
    forced = ref.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    base = forced_logits(ref, prompts, forced)
    err_sd = (forced_logits(sd, prompts, forced) - base).abs().max().item()
    fa_logits = forced_logits(fa, prompts, forced)
    err_fa = (fa_logits - base).abs().max().item()
    agree = (fa_logits.argmax(-1) == base.argmax(-1)).float().mean().item()
    print(f"max |logit - fp32 sdpa|: sdpa-bf16 {err_sd:.3f}, fa3-bf16 {err_fa:.3f}; fa3 argmax agreement {agree:.1%}")
    assert err_fa <= 2 * err_sd + 0.05
    assert fa.allocator.num_used == 0
