"""Small host lists (token ids, positions, page ids, sequence lengths) as device tensors without a host sync.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for every kernel already queued on
the stream: the engine thread then stops launching until the GPU drained, and the GPU idles while the thread
launches again. A copy from pinned memory is queued like a kernel instead (the caching host allocator keeps the
pinned block until the copy ran). Each forward builds several of these (its input ids, FA3's sequence lengths, a
layer group's page index).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def to_device(values: Iterable[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` as a 1-D `dtype` tensor on `device`; on CUDA queued on the current stream (no host sync)."""
    host = torch.tensor(values if isinstance(values, list) else list(values), dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
