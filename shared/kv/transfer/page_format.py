"""The byte layout of a batch of whole pages, shared by every transport: page-major rows of one buffer.

A batch of N pages is a uint8 buffer [N, page_bytes]; row i holds page i as
    data   [2, num_layers, page_size, kv_heads, head_dim]           layout dtype (K = 0, V = 1)
    scales [2, num_layers, page_size, kv_heads, head_dim // group]  float16 (int8 and fp8 only)
    zeros  same as scales                                            float16 (asymmetric int8 only)
in C order, little-endian (a layer group's batch: the same with that group's layers, `PageFormat(layout, n)`;
its rows are the whole rows' bytes of those layers). Tokens past a page's `num_tokens` are zero. Rows are
contiguous, so any run of pages is one contiguous byte range (a message, a staging region) and one device copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.errors import InvalidRequest
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.dtypes import DTYPES
from pdserve.kv.payload import PagePayload


@dataclass(frozen=True)
class PageFormat:
    """Segment sizes of one page row for a layout (page_size tokens; all layers, or `num_layers` of them: a layer
    group's rows, `pdserve.kv.transfer.layers`, laid out alike with that many layers)."""

    layout: KVLayoutSpec
    num_layers: int = 0  # layers in a row; 0: the layout's (whole pages)

    @property
    def layers(self) -> int:
        return self.num_layers or self.layout.num_layers

    @property
    def data_shape(self) -> tuple[int, ...]:
        lay = self.layout
        return (2, self.layers, lay.page_size, lay.num_kv_heads, lay.head_dim)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        lay = self.layout
        return (2, self.layers, lay.page_size, lay.num_kv_heads, lay.head_dim // max(lay.group_size, 1))

    @property
    def data_bytes(self) -> int:
        return math.prod(self.data_shape) * DTYPES[self.layout.dtype].itemsize

    @property
    def scales_bytes(self) -> int:
        return math.prod(self.scales_shape) * 2 if self.layout.quantized else 0

    @property
    def zeros_bytes(self) -> int:
        return self.scales_bytes if self.layout.asymmetric else 0

    @property
    def page_bytes(self) -> int:
        return self.data_bytes + self.scales_bytes + self.zeros_bytes

    # ---- pack / unpack -----------------------------------------------------------------------------------
    def pack(self, data: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None) -> torch.Tensor:
        """data [N, *data_shape] (layout dtype), scales / zeros [N, *scales_shape] float16 or None -> uint8
        [N, page_bytes] on data's device (one concatenation)."""
        n = data.shape[0]
        if tuple(data.shape[1:]) != self.data_shape or data.dtype != self.layout.torch_dtype:
            raise InvalidRequest(f"batch data {tuple(data.shape)} {data.dtype} does not fit {self.layout}")
        parts = [data.contiguous().view(torch.uint8).reshape(n, -1)]
        for t, want in ((scales, self.scales_bytes), (zeros, self.zeros_bytes)):
            if want == 0:
                if t is not None:
                    raise InvalidRequest("scales / zeros given for a layout without them")
                continue
            if t is None or tuple(t.shape[1:]) != self.scales_shape or t.dtype != torch.float16:
                raise InvalidRequest(f"batch scales / zeros do not fit {self.scales_shape} float16")
            parts.append(t.contiguous().view(torch.uint8).reshape(n, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """uint8 [N, page_bytes] -> views data [N, *data_shape], scales / zeros [N, *scales_shape] or None."""
        if rows.dim() != 2 or rows.shape[1] != self.page_bytes or rows.dtype != torch.uint8:
            raise InvalidRequest(f"batch rows {tuple(rows.shape)} {rows.dtype} != [N, {self.page_bytes}] uint8")
        n = rows.shape[0]
        a, b = self.data_bytes, self.data_bytes + self.scales_bytes
        data = rows[:, :a].view(self.layout.torch_dtype).view(n, *self.data_shape)
        if not self.layout.quantized:
            return data, None, None
        scales = rows[:, a:b].view(torch.float16).view(n, *self.scales_shape)
        zeros = rows[:, b:].view(torch.float16).view(n, *self.scales_shape) if self.zeros_bytes else None
        return data, scales, zeros

    def rows_from_payloads(self, payloads: list[PagePayload]) -> torch.Tensor:
        """CPU PagePayloads (all layers, this layout) -> uint8 [N, page_bytes] CPU (prompt-cache hits): one copy
        per page into its row; only the tokens past a partial page's end are zeroed."""
        rows = torch.empty(len(payloads), self.page_bytes, dtype=torch.uint8)
        data, scales, zeros = self.unpack(rows)
        ps = self.layout.page_size
        for i, p in enumerate(payloads):
            if p.layer_start != 0 or p.layer_count != self.layout.num_layers:
                raise InvalidRequest(f"page {p.page_index}: batches carry all layers")
            k = p.num_tokens
            for dst, src in ((data, p.data), (scales, p.scales), (zeros, p.zeros)):
                if dst is None:
                    continue
                if src is None:
                    raise InvalidRequest(f"page {p.page_index}: scales / zeros missing for {self.layout}")
                dst[i, :, :, :k] = src
                if k < ps:
                    dst[i, :, :, k:] = 0
        return rows

    def payloads(self, rows: torch.Tensor, page_indexes: list[int], num_tokens: list[int]) -> list[PagePayload]:
        """uint8 [N, page_bytes] -> PagePayloads (own CPU copies, first num_tokens tokens of each page)."""
        data, scales, zeros = self.unpack(rows)
        out = []
        for i, (idx, k) in enumerate(zip(page_indexes, num_tokens)):
            out.append(
                PagePayload(
                    page_index=idx,
                    num_tokens=k,
                    layer_start=0,
                    data=data[i, :, :, :k].to("cpu", copy=True),
                    scales=None if scales is None else scales[i, :, :, :k].to("cpu", copy=True),
                    zeros=None if zeros is None else zeros[i, :, :, :k].to("cpu", copy=True),
                    group_size=self.layout.group_size,
                )
            )
        return out
