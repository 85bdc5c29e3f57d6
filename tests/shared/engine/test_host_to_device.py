"""to_device: host lists as device tensors, the same values as torch.tensor's, and on CUDA without waiting for the
kernels queued before the copy (the engine thread keeps its lead over the GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.host_to_device import to_device


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32])
def test_same_values_and_dtype_as_torch_tensor(dtype):
    values = [0, 3, 7, 1 << 20]
    got = to_device(values, dtype, torch.device("cpu"))
    assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
    assert to_device([], dtype, torch.device("cpu")).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_copy_does_not_wait_for_queued_kernels():
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about a second of GPU time queued ahead of the copy
    t0 = time.perf_counter()
    got = to_device(list(range(4096)), torch.long, dev)
    waited = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    assert busy and waited < 0.1, f"to_device waited {waited:.3f} s for the queued kernel"
    assert got.tolist() == list(range(4096))  # stream order: the copy ran after the kernel, before this read
