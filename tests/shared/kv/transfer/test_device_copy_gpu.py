"""A receiver's side-stream copy never writes into memory a kernel still queued on the engine's stream reads
(skipped without CUDA; the race needs real streams and the caching allocator, which CPU tests do not have).

The H200 failure it guards: the engine freed a scatter's page index tensor right after queueing the scatter, a copy
thread's next small batch got that block from the engine stream's pool and overwrote it from a side stream before
the scatter ran (IndexKernel.cu "index out of bounds"; grpc, 32 layers in groups of 4).

    .venv/bin/python -m pytest -q tests/shared/kv/transfer/test_device_copy_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.transfer.cuda_ipc import CudaIpcCopier
from pdserve.kv.transfer.device_copy import copy_to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N = 64  # index entries: 512 bytes, one small-pool block
BUSY_CYCLES = 50_000_000  # tens of ms of queued work on the engine's stream


@pytest.mark.parametrize("path", ["helper", "ipc-fetch"])
def test_copy_does_not_reuse_a_block_freed_with_a_kernel_still_queued(path):
    dev = torch.device("cuda:0")
    table = torch.arange(1000, device=dev)
    side = torch.cuda.Stream(device=dev)
    copier = CudaIpcCopier(dev)
    zeros_host = torch.zeros(N * 8, dtype=torch.uint8).pin_memory()
    zeros_dev = torch.zeros(N * 8, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    for _ in range(5):
        idx = torch.full((N,), 5, dtype=torch.long, device=dev)  # the engine's index tensor (its current stream)
        torch.cuda._sleep(BUSY_CYCLES)  # the engine stream is busy (a decode step in flight)
        out = table[idx]  # queued behind it
        del idx  # freed at once: the engine stream may reuse it, in stream order
        got = copy_to_device(zeros_host, dev, side) if path == "helper" else copier.fetch(zeros_dev)
        assert torch.equal(got.cpu(), torch.zeros(N * 8, dtype=torch.uint8))
        assert out.cpu().tolist() == [5] * N  # its index was not overwritten by the side-stream copy


def test_copied_rows_freed_by_the_engine_are_not_reused_before_its_queued_work():
    dev = torch.device("cuda:0")
    table = torch.arange(1000, device=dev)
    side = torch.cuda.Stream(device=dev)
    fives = torch.full((N,), 5, dtype=torch.long).pin_memory()
    zeros = torch.zeros(N, dtype=torch.long).pin_memory()
    torch.cuda.synchronize()
    for _ in range(5):
        rows = copy_to_device(fives, dev, side)  # a received batch, used as an index on the engine's stream
        torch.cuda._sleep(BUSY_CYCLES)
        out = table[rows]
        del rows  # the engine drops the batch once its scatter is queued
        copy_to_device(zeros, dev, side)  # the next batch, on the same side stream
        assert out.cpu().tolist() == [5] * N
