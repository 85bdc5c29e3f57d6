"""Host lists as device tensors without a host-GPU sync.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream: the calling
thread waits until every kernel queued before the copy has run. On the engine thread that costs the lead it keeps
over the GPU: the next prefill chunk's kernels cannot be launched while the GPU still computes this one, and a
prefill whose host time per chunk is close to its GPU time (docs/benchmarks.md, "One GPU") idles the GPU at each such
call. Through pinned memory the copy is queued in stream order and the thread goes on; PyTorch's caching host
allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D `dtype` tensor on `device`; on CUDA through pinned memory, so the copy does not wait for
    the GPU."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
