"""KV pages imported into a tensor-parallel pool (a decode instance at TP > 1 receiving a TP=1 prefill's pages, which
hold every KV head): rank 0 writes its own heads and broadcasts the batch; each follower keeps the heads it holds
(`RankLayout.kv_heads`, replicated ones included) and writes them into its pool.

The SCATTER message (int64, then one byte broadcast per present tensor, on the model's group):

    [SCATTER, n, pages(n), group_size, span_start, span_stop, then for data, scales, zeros:
     present, dtype code, ndim, shape(ndim)]

span (-1, -1): every layer. Tensors travel as their bytes (fp8 and bf16 too) and are rebuilt from dtype and shape.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.tp.comm import MAX_BROADCAST_BYTES, TPGroup

SCATTER = 6
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn)
MAX_NDIM = 8

Batch = tuple[list[int], torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, tuple[int, int] | None]


def local_heads(t: torch.Tensor | None, heads: torch.Tensor) -> torch.Tensor | None:
    """The KV heads `heads` (axis 4 of [N, 2, L, page_size, kv_heads, d | G]) of a page batch tensor."""
    return None if t is None else t.index_select(4, heads.to(t.device))


def send_scatter(
    group: TPGroup,
    pages: list[int],
    data: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    group_size: int,
    span: tuple[int, int] | None,
) -> None:
    """Rank 0: broadcast a page batch of every KV head (the followers' `receive_scatter`)."""
    msg = [SCATTER, len(pages), *pages, group_size, *(span if span is not None else (-1, -1))]
    tensors = [t.contiguous() for t in (data, scales, zeros) if t is not None]
    for t in (data, scales, zeros):
        msg += [0] if t is None else [1, DTYPES.index(t.dtype), t.dim(), *t.shape]
    group.broadcast_ints(torch.tensor(msg, dtype=torch.int64))
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8)
        group.broadcast_bytes(raw, raw.numel())


def receive_scatter(group: TPGroup, msg: torch.Tensor, num_pages: int) -> Batch:
    """A follower: the batch of a SCATTER message (and the byte broadcasts after it); ValueError for a message
    that does not add up."""
    v = msg.tolist()
    if len(v) < 2 or v[0] != SCATTER or v[1] < 0 or len(v) < 5 + v[1]:
        raise ValueError("malformed SCATTER message")
    n = v[1]
    pages = v[2 : 2 + n]
    if any(not 0 <= p < num_pages for p in pages):
        raise ValueError("SCATTER page outside the pool")
    group_size, start, stop = v[2 + n : 5 + n]
    span = None if (start, stop) == (-1, -1) else (start, stop)
    pos = 5 + n
    specs: list[tuple[torch.dtype, list[int]] | None] = []
    for _ in range(3):
        if pos >= len(v) or v[pos] not in (0, 1):
            raise ValueError("malformed SCATTER tensor header")
        if v[pos] == 0:
            specs.append(None)
            pos += 1
            continue
        code, ndim = v[pos + 1], v[pos + 2]
        shape = v[pos + 3 : pos + 3 + ndim]
        if not 0 <= code < len(DTYPES) or not 0 < ndim <= MAX_NDIM or len(shape) != ndim or min(shape) < 0:
            raise ValueError("malformed SCATTER tensor header")
        specs.append((DTYPES[code], shape))
        pos += 3 + ndim
    if pos != len(v) or specs[0] is None:
        raise ValueError("malformed SCATTER message: trailing values or no data")
    out: list[torch.Tensor | None] = []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        dtype, shape = spec
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if nbytes > MAX_BROADCAST_BYTES:
            raise ValueError(f"SCATTER tensor of {nbytes} bytes exceeds {MAX_BROADCAST_BYTES}")
        out.append(group.broadcast_bytes(None, nbytes).view(dtype).reshape(shape))
    data = out[0]
    assert data is not None
    return pages, data, out[1], out[2], group_size, span
