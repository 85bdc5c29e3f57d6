"""engine/attention.py on CPU: which launch config the Triton int8 decode kernel gets per pool, and how FA3Backend
splits a mixed step (decode rows, prefill rows) between its decode and prefill calls."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import int8_launch_config

# the shapes of int8_decode_attention's DEFAULT_CONFIG / TILE_LAUNCH (that module needs Triton, absent on CPU CI)
DEFAULT = dict(block_n=32, num_warps=1, num_stages=3, split_mult=5)
TILE = dict(block_n=128, num_warps=4, num_stages=3)


def test_plane_pools_keep_the_one_warp_default():
    assert int8_launch_config(DEFAULT, TILE, {}, 128, 2, False) == DEFAULT
    assert int8_launch_config(DEFAULT, TILE, {}, 256, 2, False) == DEFAULT
    got = int8_launch_config(DEFAULT, TILE, {"split_mult": 2}, 128, 2, False)
    assert got == {**DEFAULT, "split_mult": 2}


@pytest.mark.parametrize(
    ("head_dim", "groups", "asym", "overrides"),
    [
        (128, 2, True, {}),  # asymmetric: the tile kernel
        (128, 4, False, {}),  # group 32 at head_dim 128
        (128, 1, False, {}),  # one group per head
        (64, 2, False, {}),  # head_dim 64: the fold2 kernel
        (64, 2, False, {"num_stages": 2}),
    ],
)
def test_other_int8_pools_get_the_tile_launch(head_dim, groups, asym, overrides):
    got = int8_launch_config(DEFAULT, TILE, overrides, head_dim, groups, asym)
    assert got == {**DEFAULT, **TILE, **overrides}


def test_overrides_win_over_the_tile_launch():
    got = int8_launch_config(DEFAULT, TILE, {"num_warps": 8, "block_n": 64}, 128, 2, True)
    assert (got["num_warps"], got["block_n"], got["num_stages"]) == (8, 64, 3)


def test_the_shapes_above_are_the_kernel_modules():
    """Where Triton is installed: DEFAULT / TILE above are int8_decode_attention's (the GPU's launch configs)."""
    pytest.importorskip("triton")
    from pdserve.engine.kernels import int8_decode_attention as kd

    assert kd.DEFAULT_CONFIG == DEFAULT and kd.TILE_LAUNCH == TILE
    for head_dim, groups, asym in [(128, 2, False), (256, 2, False), (128, 2, True), (128, 4, False), (64, 2, False)]:
        planes = int8_launch_config(DEFAULT, TILE, {}, head_dim, groups, asym) == DEFAULT
        assert kd.reads_planes(head_dim, groups, asym) == planes  # the launch follows the kernel the shape picks


# ---- FA3Backend on a mixed step: decode rows and prefill rows attended apart -------------------------------------
class TorchFlashAttn:
    """A stand-in for flash_attn_interface's paged `flash_attn_with_kvcache` in plain torch (CPU): q [B, 1, H, D]
    (decode) or varlen q [T, H, D] with cu_seqlens_q, causal aligned bottom-right. Records each call's kind."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def flash_attn_with_kvcache(
        self, q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, causal, cu_seqlens_q=None, **_
    ):
        assert causal
        decode = cu_seqlens_q is None
        self.calls.append(("decode" if decode else "prefill", q.shape[0]))
        rows = q[:, 0] if decode else q  # [T, H, D]
        cu = list(range(q.shape[0] + 1)) if decode else cu_seqlens_q.tolist()
        ps, out = k_cache.shape[1], torch.empty_like(rows)
        for b, n_keys in enumerate(cache_seqlens.tolist()):
            pages = page_table[b, : -(-n_keys // ps)].long()
            k = k_cache[pages].flatten(0, 1)[:n_keys]  # [n_keys, KVH, D]
            v = v_cache[pages].flatten(0, 1)[:n_keys]
            qb = rows[cu[b] : cu[b + 1]]  # [n, H, D]
            n, rep = qb.shape[0], qb.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.einsum("nhd,khd->hnk", qb, k) * softmax_scale
            sees = torch.arange(n_keys)[None, :] <= torch.arange(n_keys - n, n_keys)[:, None]  # [n, n_keys]
            probs = scores.masked_fill(~sees, float("-inf")).softmax(-1)
            out[cu[b] : cu[b + 1]] = torch.einsum("hnk,khd->nhd", probs, v)
        return out[:, None] if decode else out


def test_fa3_backend_attends_a_mixed_steps_decode_and_prefill_rows_apart():
    """Two decode rows (long contexts) then two prefill chunks: the decode rows go through the decode call, the
    chunks through one varlen prefill call, and the result is the SDPA backend's."""
    from pdserve.engine.attention import AttentionMetadata, FA3Backend, SdpaBackend
    from pdserve.engine.kernel_choice import KernelChoice
    from pdserve.engine.kv_cache import KVCache

    torch.manual_seed(0)
    ps, H, KVH, D, dev = 4, 4, 2, 8, torch.device("cpu")
    pool = KVCache(1, 32, ps, KVH, D, torch.float32, dev)
    tables = [[3, 9, 4, 1, 7], [11, 2], [5, 6, 8], [12, 13, 14, 15]]
    starts, q_lens = [17, 6, 0, 9], [1, 1, 10, 5]  # decode at 17 and 6; chunks 0..9 and 9..13
    meta = AttentionMetadata(starts, q_lens, tables, ps, dev, num_decode=2)
    assert meta.is_mixed and not meta.is_decode
    for seq, start in enumerate(starts):  # earlier tokens' K/V, as earlier steps wrote them
        if start:
            old = AttentionMetadata([0], [start], [tables[seq]], ps, dev)
            pool.write(0, old.slot_mapping, torch.randn(start, KVH, D), torch.randn(start, KVH, D))
    T = sum(q_lens)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    pool.write(0, meta.slot_mapping, k, v)
    fa = TorchFlashAttn()
    backend = FA3Backend(fa, KernelChoice(dense_decode="fa3", dense_prefill="paged"))
    out = backend.attend(0, q, meta, pool, D**-0.5)
    ref = SdpaBackend().attend(0, q, AttentionMetadata(starts, q_lens, tables, ps, dev), pool, D**-0.5)
    assert fa.calls == [("decode", 2), ("prefill", 15)]
    assert (out - ref).abs().max().item() < 1e-5
    decode, prefill = meta.split()
    assert decode.positions.tolist() == [17, 6] and prefill.q_lens == [10, 5] and prefill.num_decode == 0
