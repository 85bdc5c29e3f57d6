"""Decode CUDA graph sizing and GPU KV pool sizing as pure functions (CPU; the captures run in the GPU tests)."""

from types import SimpleNamespace

from pdserve.engine.config import CUDA_CONTEXT_BYTES, gpu_kv_pool_bytes
from pdserve.engine.cuda_graphs import (
    GRAPH_SCRATCH_BUDGET_BYTES,
    capturable_sizes,
    default_batch_sizes,
    graph_context,
    scratch_bytes_per_row,
    static_buffer_bytes,
)

GiB = 1 << 30


def test_graphs_cover_the_whole_context_unless_capped():
    assert graph_context(131072, 0, 16) == 131072  # default: the model's whole context, not 8192
    assert graph_context(16384, 8192, 16) == 8192  # an explicit cap below it
    assert graph_context(4096, 8192, 16) == 4096  # a cap above the model's context changes nothing
    assert graph_context(1000, 0, 16) == 1008  # whole pages


def test_static_buffers_are_shared_and_small_at_full_context():
    # 64 rows at 128k context, 16-token pages: 8192 table entries a row, one buffer set for every batch size
    assert static_buffer_bytes(64, 131072 // 16) == 4 * 64 * (4 + 8192)
    assert static_buffer_bytes(64, 8192) < 3 * 2**20


def test_only_the_dequant_kernel_has_a_context_sized_scratch():
    int8 = SimpleNamespace(quantized=True, num_kv_heads=8, head_dim=128)
    dense = SimpleNamespace(quantized=False, num_kv_heads=8, head_dim=128)
    triton, dequant = SimpleNamespace(int8_decode="triton"), SimpleNamespace(int8_decode="dequant")
    assert scratch_bytes_per_row(int8, triton, 1024, 16, 2) == 0
    assert scratch_bytes_per_row(dense, dequant, 1024, 16, 2) == 0
    per_row = scratch_bytes_per_row(int8, dequant, 1024, 16, 2)  # [2, W·ps, KVH, D] bf16
    assert per_row == 2 * 1024 * 16 * 8 * 128 * 2 == 64 * 2**20
    sizes = default_batch_sizes(64)
    assert capturable_sizes(sizes, 0) == sizes
    assert capturable_sizes(sizes, per_row) == [s for s in sizes if s * per_row <= GRAPH_SCRATCH_BUDGET_BYTES]
    assert capturable_sizes(sizes, per_row)[-1] == 32  # 32 × 64 MiB = the 2 GiB budget


def test_gpu_kv_pool_from_the_instance_share_of_total_memory():
    total = 140 * GiB
    # alone on the GPU: 0.9 of total less what it holds (weights, context)
    assert gpu_kv_pool_bytes(total, total - 17 * GiB, 17 * GiB, 0.9) == int(0.9 * total - 17 * GiB)
    # two instances at 0.45 each on one GPU: the second sizes from its own share although the first one
    # already took its part, and together they stay within the device
    first = gpu_kv_pool_bytes(total, total - 17 * GiB, 17 * GiB, 0.45)
    free_after_first = total - 17 * GiB - first - 17 * GiB  # the second loaded its weights too
    second = gpu_kv_pool_bytes(total, free_after_first, 17 * GiB, 0.45)
    assert first == second == int(0.45 * total - 17 * GiB)
    assert first + second + 2 * 17 * GiB <= 0.9 * total
    # never more than what is free now (less a margin), e.g. a foreign process holds most of the device
    assert gpu_kv_pool_bytes(total, 20 * GiB, 17 * GiB, 0.9) == 20 * GiB - CUDA_CONTEXT_BYTES
    # nothing left: <= 0 (the runner refuses to start)
    assert gpu_kv_pool_bytes(total, total, 70 * GiB, 0.45) <= 0
