"""page_upload.upload_stacked: the grouped, threaded host copy gives exactly torch.stack, for any group size,
non-contiguous pages and a pool or none (the CUDA path adds only the per-group device copy, GPU-tested below)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.engine.page_upload import upload_stacked


def pages(n: int, dtype=torch.int8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(-128, 127, (2, 3, 4, 2, 8), generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("group_bytes", [1, 384, 1000, 1 << 20])
@pytest.mark.parametrize("threads", [0, 3])
def test_equals_torch_stack_for_every_grouping(group_bytes, threads):
    ps = pages(11)
    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        out = upload_stacked(ps, torch.device("cpu"), pool, group_bytes)
    finally:
        if pool:
            pool.shutdown()
    assert torch.equal(out, torch.stack(ps))


def test_non_contiguous_and_float_pages():
    base = [torch.randn(4, 6, dtype=torch.float16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    ps = [t.t() for t in base]  # [6, 4], not contiguous
    with ThreadPoolExecutor(2) as pool:
        out = upload_stacked(ps, torch.device("cpu"), pool, group_bytes=100)
    assert torch.equal(out, torch.stack(ps))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_upload_equals_stack_and_survives_buffer_reuse():
    ps = pages(37)
    with ThreadPoolExecutor(4) as pool:
        outs = [upload_stacked(ps, torch.device("cuda"), pool, group_bytes=4096) for _ in range(3)]
    torch.cuda.synchronize()
    want = torch.stack(ps)
    assert all(torch.equal(o.cpu(), want) for o in outs)
