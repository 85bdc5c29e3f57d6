"""KV pages exported from a tensor-parallel pool (a prefill instance at TP > 1 shipping to decode, or a TP > 1 instance
writing pages to the prompt cache): every rank gathers (and quantizes, when the layout is int8 / fp8) the pages'
rows of its own KV heads, the ranks' parts are gathered onto rank 0, and rank 0 assembles the TP-independent page,
every KV head once in global order (`assemble`): the page a TP=1 instance exports. So a decode instance or a prompt
cache reader at any TP size reads the same bytes, and each of its ranks keeps its own heads (`page_import`).

Quantization (int8 / fp8) is per (token, KV head, group): a head quantized on its rank is bit for bit the head
quantized after assembly, and the ranks send rank 0 a quarter of float32's bytes. A KV head replicated on several
ranks (N > KV heads) comes from the first rank that holds it.

Why rank 0: the gRPC stream of a request ends in rank 0's process (the instance's server), so its bytes pass there
on the `grpc` transport whatever the layout; rank 0 receives each rank's heads once (one `gather`, no broadcast).

The GATHER message (int64, on the plan group), then one byte gather per present tensor on the model's group:

    [GATHER, n, pages(n), num_tokens(n), quantized, group_size, asymmetric, dtype code, span_start, span_stop]

span (-1, -1): every layer; dtype code -1: the pool's own dtype. Every rank's tensors have one shape (each holds
`kv_per_rank` heads), so they travel as equal byte buffers and are rebuilt from dtype and shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.tp.comm import TPGroup
from pdserve.engine.tp.layout import TPLayout
from pdserve.engine.tp.page_import import DTYPES

GATHER = 7
_FIXED = 8  # GATHER, n, then after the pages and token counts: quantized, group, asymmetric, dtype, start, stop

Parts = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # data, scales, zeros [N, 2, L, ps, kvh, x]
# the pool's own gather_pages: (page_ids, num_tokens, quantized, group_size, asymmetric, dtype, layers) -> Parts
LocalGather = Callable[..., Parts]


def gather_message(
    page_ids: list[int],
    num_tokens: list[int],
    quantized: bool,
    group_size: int,
    asymmetric: bool,
    dtype: torch.dtype | None,
    layers: tuple[int, int] | None,
) -> torch.Tensor:
    """The GATHER message of one export."""
    if len(page_ids) != len(num_tokens):
        raise ValueError(f"gather of {len(page_ids)} pages with {len(num_tokens)} token counts")
    code = -1 if dtype is None else DTYPES.index(dtype)
    span = layers if layers is not None else (-1, -1)
    head = [GATHER, len(page_ids), *page_ids, *num_tokens]
    return torch.tensor([*head, int(quantized), group_size, int(asymmetric), code, *span], dtype=torch.int64)


def decode_gather(msg: torch.Tensor, num_pages: int, page_size: int) -> tuple:
    """A GATHER message -> the arguments of the pool's `gather_pages`; ValueError for one that does not add up."""
    v = msg.tolist()
    if len(v) < 2 or v[0] != GATHER or v[1] < 0 or len(v) != _FIXED + 2 * v[1]:
        raise ValueError("malformed GATHER message")
    n = v[1]
    pages, tokens = v[2 : 2 + n], v[2 + n : 2 + 2 * n]
    quantized, group_size, asymmetric, code, start, stop = v[2 + 2 * n :]
    if any(not 0 <= p < num_pages for p in pages) or any(not 1 <= t <= page_size for t in tokens):
        raise ValueError("GATHER page outside the pool or token count outside the page")
    if quantized not in (0, 1) or asymmetric not in (0, 1) or group_size < 0 or not -1 <= code < len(DTYPES):
        raise ValueError("malformed GATHER format")
    layers = None if (start, stop) == (-1, -1) else (start, stop)
    return pages, tokens, bool(quantized), group_size, bool(asymmetric), None if code < 0 else DTYPES[code], layers


@dataclass(frozen=True)
class LayerExport:
    """A layer group a step's forward exports once its last layer's K/V are written (a prefill chunk streaming its
    pages, `--kv-layer-group`): layers [start, stop) of physical `pages`. The STEP plan carries these (`worker`), so
    every rank's forward gathers its part at the same layer as rank 0's hook."""

    start: int
    stop: int
    pages: list[int]
    num_tokens: list[int]
    quantized: bool
    group_size: int
    asymmetric: bool
    dtype: torch.dtype | None

    def gather_args(self) -> tuple[list[int], list[int], bool, int, bool, torch.dtype | None, tuple[int, int]]:
        """The pool's `gather_pages` arguments (all but `index`)."""
        q, g, a = self.quantized, self.group_size, self.asymmetric
        return self.pages, self.num_tokens, q, g, a, self.dtype, (self.start, self.stop)

    def message(self) -> torch.Tensor:
        return gather_message(*self.gather_args())

    @classmethod
    def decode_all(cls, tail: list[int], num_pages: int, page_size: int) -> list[LayerExport]:
        """A STEP message's tail ([] or [count, GATHER messages]) -> the exports; ValueError if it does not add up."""
        if not tail:
            return []
        count, pos, out = tail[0], 1, []
        for _ in range(count):
            n = tail[pos + 1] if pos + 1 < len(tail) else -1
            size = _FIXED + 2 * n
            if n < 0 or pos + size > len(tail):
                raise ValueError("layer exports end inside a GATHER message")
            pages, tokens, q, g, a, dtype, layers = decode_gather(
                torch.tensor(tail[pos : pos + size]), num_pages, page_size
            )
            if layers is None:
                raise ValueError("a layer export names no layers")
            out.append(cls(layers[0], layers[1], pages, tokens, q, g, a, dtype))
            pos += size
        if count < 1 or pos != len(tail):
            raise ValueError(f"{len(tail) - pos} ints past {count} layer exports")
        return out


def _gather_bytes(group: TPGroup, t: torch.Tensor | None) -> list[torch.Tensor] | None:
    """Every rank's `t` (one shape and dtype on every rank) as byte buffers on rank 0 (None elsewhere)."""
    if t is None:
        return None
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(group.world_size)] if group.is_root else None
    dist.gather(raw, parts, dst=0)
    return parts


def send_parts(group: TPGroup, parts: Parts) -> None:
    """A follower: its heads' part of the export rank 0 asked for (the GATHER message)."""
    for t in parts:
        _gather_bytes(group, t)


def assembly_index(layout: TPLayout) -> torch.Tensor:
    """Positions, in the ranks' parts concatenated along the head axis, of global KV heads 0..KVH-1: each from the
    first rank holding it (a replicated head is the same values on every rank that holds it)."""
    held = [h for r in layout.ranks for h in r.kv_heads]  # global head of each position of the concatenation
    first: dict[int, int] = {}
    for pos, h in enumerate(held):
        first.setdefault(h, pos)
    if sorted(first) != list(range(len(first))):
        raise ValueError(f"the ranks hold KV heads {sorted(first)}, not 0..{len(first) - 1}")
    return torch.tensor([first[h] for h in range(len(first))], dtype=torch.long)


def assemble(layout: TPLayout, per_rank: list[torch.Tensor], index: torch.Tensor | None = None) -> torch.Tensor:
    """Each rank's [N, 2, L, ps, kv_per_rank, x] -> [N, 2, L, ps, KVH, x] (`index`: `assembly_index(layout)` on the
    parts' device, made ahead: no host-to-device copy inside a forward)."""
    if index is None:
        index = assembly_index(layout).to(per_rank[0].device)
    return torch.cat(per_rank, dim=4).index_select(4, index)


def gather_all_heads(group: TPGroup, layout: TPLayout, local: Parts, index: torch.Tensor | None = None) -> Parts:
    """Rank 0, after broadcasting the GATHER message (or inside a step that names the export): its own `local`
    part and the followers' (`send_parts`) -> the pages of every KV head, on rank 0's device."""
    out: list[torch.Tensor | None] = []
    for t in local:
        parts = _gather_bytes(group, t)
        if t is None or parts is None:
            out.append(None)
            continue
        out.append(assemble(layout, [p.view(t.dtype).view(t.shape) for p in parts], index))
    data = out[0]
    assert data is not None
    return data, out[1], out[2]


def leader_gather(group: TPGroup, layout: TPLayout, local_gather: LocalGather, guard) -> LocalGather:
    """Rank 0's `gather_pages` for a TP pool (the pool's signature): the pages of every KV head. Rank 0 gathers
    its own heads first, so a bad request (unknown page, token count) fails before anything is broadcast; the
    broadcast and the collective run under `guard` (the supervisor's: a failure there ends the instance). With
    `index` (the layer hook, inside a forward, `kv_handoff`) nothing is broadcast: the ranks are inside the same
    step, whose plan named this export (`LayerExport`), and their hooks join the collective at this layer; the
    forward's own guard holds the group."""
    order = assembly_index(layout).to(group.device)  # made once: the in-forward path copies nothing to the device

    def gather_pages(
        page_ids: list[int],
        num_tokens: list[int],
        quantized: bool,
        group_size: int = 0,
        asymmetric: bool = False,
        dtype: torch.dtype | None = None,
        layers: tuple[int, int] | None = None,
        index: torch.Tensor | None = None,
    ) -> Parts:
        mine = local_gather(page_ids, num_tokens, quantized, group_size, asymmetric, dtype, layers, index)
        if index is not None:  # inside the step's forward: every rank's hook gathers this group now
            return gather_all_heads(group, layout, mine, order)
        msg = gather_message(page_ids, num_tokens, quantized, group_size, asymmetric, dtype, layers)
        with guard():
            group.broadcast_ints(msg)
            return gather_all_heads(group, layout, mine, order)

    return gather_pages
