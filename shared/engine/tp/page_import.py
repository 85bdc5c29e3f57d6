"""KV pages imported into a tensor-parallel pool (a decode instance at TP > 1 receiving pages from prefill, or any
TP > 1 instance loading prompt-cache pages): the pages hold every KV head in global order, whatever the TP size of
the instance that computed them (`page_export`). Rank 0 writes its own heads and sends each follower exactly the heads
it holds (`RankLayout.kv_heads`, replicated ones included: one `scatter`, never the whole batch to every rank);
each follower writes them into its pool.

The SCATTER message (int64 on the plan group, then one byte scatter per present tensor on the model's group):

    [SCATTER, n, pages(n), group_size, span_start, span_stop, then for data, scales, zeros:
     present, dtype code, ndim, shape(ndim)]

span (-1, -1): every layer. The shapes are a rank's part ([N, 2, L, page_size, kv_per_rank, d | G]: one shape on
every rank). Tensors travel as their bytes (fp8 and bf16 too) and are rebuilt from dtype and shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdserve.engine.tp.comm import MAX_BROADCAST_BYTES, TPGroup
from pdserve.engine.tp.layout import TPLayout
from pdserve.errors import InvalidRequest
from pdserve.kv.payload import PagePayload

SCATTER = 6
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn)
MAX_NDIM = 8

Batch = tuple[list[int], torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, tuple[int, int] | None]


def local_heads(t: torch.Tensor | None, heads: torch.Tensor) -> torch.Tensor | None:
    """The KV heads `heads` (axis 4 of [N, 2, L, page_size, kv_heads, d | G]) of a page batch tensor."""
    return None if t is None else t.index_select(4, heads.to(t.device))


def rank_parts(t: torch.Tensor, layout: TPLayout) -> list[torch.Tensor]:
    """A batch tensor of every KV head [N, 2, L, ps, KVH, x] -> each rank's heads [N, 2, L, ps, kv_per_rank, x]."""
    return [t.index_select(4, torch.tensor(r.kv_heads, dtype=torch.long, device=t.device)) for r in layout.ranks]


def _scatter_bytes(group: TPGroup, parts: list[torch.Tensor] | None, nbytes: int) -> torch.Tensor:
    """Rank 0 passes one uint8-viewable tensor per rank (equal byte sizes), the others None: this rank's bytes, on
    the group's device."""
    if not 0 <= nbytes <= MAX_BROADCAST_BYTES:
        raise ValueError(f"scatter of {nbytes} bytes outside 0..{MAX_BROADCAST_BYTES}")
    out = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    if parts is None:
        dist.scatter(out, None, src=0)
        return out
    raw = [p.to(group.device).reshape(-1).view(torch.uint8) for p in parts]
    if any(r.numel() != nbytes for r in raw):
        raise ValueError("scatter parts of unequal sizes")
    dist.scatter(out, raw, src=0)
    return out


def send_scatter(
    group: TPGroup,
    layout: TPLayout,
    pages: list[int],
    data: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    group_size: int,
    span: tuple[int, int] | None,
) -> None:
    """Rank 0: send each follower its heads of a page batch of every KV head (the followers' `receive_scatter`)."""
    msg = [SCATTER, len(pages), *pages, group_size, *(span if span is not None else (-1, -1))]
    split = [None if t is None else rank_parts(t, layout) for t in (data, scales, zeros)]
    for parts in split:
        msg += [0] if parts is None else [1, DTYPES.index(parts[0].dtype), parts[0].dim(), *parts[0].shape]
    group.broadcast_ints(torch.tensor(msg, dtype=torch.int64))
    for parts in split:
        if parts is not None:
            _scatter_bytes(group, parts, parts[0].numel() * parts[0].element_size())


def receive_scatter(group: TPGroup, msg: torch.Tensor, num_pages: int) -> Batch:
    """A follower: its heads of the batch of a SCATTER message (the byte scatters after it); ValueError for a
    message that does not add up."""
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
        out.append(_scatter_bytes(group, None, nbytes).view(dtype).reshape(shape))
    data = out[0]
    assert data is not None
    return pages, data, out[1], out[2], group_size, span


def payload_checker(check: Callable[[PagePayload], None], kv_heads: tuple[int, ...], num_kv_heads: int):
    """Rank 0's `check_payload` for a TP pool: a prompt-cache page holds every KV head (whatever the TP size of the
    instance that wrote it); it is checked as rank 0's heads of it, the pool's own check."""
    heads = torch.tensor(kv_heads, dtype=torch.long)

    def check_payload(p: PagePayload) -> None:
        if p.data.dim() != 5 or p.data.shape[3] != num_kv_heads:
            raise InvalidRequest(
                f"payload data shape {tuple(p.data.shape)}: a tensor-parallel pool takes pages of all {num_kv_heads} "
                "KV heads ([2, layers, tokens, kv_heads, head_dim])"
            )
        pick = [None if t is None else t.index_select(3, heads) for t in (p.scales, p.zeros)]
        check(dataclasses.replace(p, data=p.data.index_select(3, heads), scales=pick[0], zeros=pick[1]))

    return check_payload
