"""Paged KV pools: dense (model dtype) and quantized (int8 or fp8 e4m3fn, group-wise fp16 scales, int8 optionally
with zero points).

Both store K and V together, index 0 = K, 1 = V:
    data   [2, num_layers, num_pages, page_size, kv_heads, head_dim]          model dtype | int8 | float8_e4m3fn
    scales [2, num_layers, num_pages, page_size, kv_heads, head_dim // group]  float16 (quantized pools only)
    zeros  same as scales                                                       float16 (asymmetric int8 only)
A token's "slot" is `page * page_size + offset`; attention reads a sequence's pages through its page table.
(De)quantization goes through `quant` (`pdserve.kv.quant`, or the engine's KernelChoice, which runs the
bit-identical Triton kernels on CUDA).

Batches of whole pages (`gather_pages` / `scatter_pages`, the disaggregated handoff and the prompt cache) name their
format by (`quantized`, group_size, asymmetric, dtype): quantized with dtype int8 (the default) or float8_e4m3fn, or
dense in dtype (default: the model dtype). Data in the pool's own format is copied straight; any other is converted
through float32. `import_page` writes one prompt-cache page (a PagePayload) the same way.
"""

from __future__ import annotations

import torch

from pdserve.engine.host_to_device import to_device
from pdserve.errors import InvalidRequest
from pdserve.kv import quant as torch_quant
from pdserve.kv.dtypes import DTYPES, QUANTIZED
from pdserve.kv.payload import PagePayload

QUANTIZED_DTYPES = tuple(DTYPES[n].torch_dtype for n in QUANTIZED)  # torch.int8, torch.float8_e4m3fn
_ALL = slice(None)  # every layer of a batch


def _ids(ids, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long)
    return to_device(list(ids), torch.long, device)  # no host-GPU sync (host_to_device)


def _zero_tails(pages: torch.Tensor, num_tokens: list[int], page_size: int) -> None:
    """pages [N, 2, L, ps, ...]: zero the tokens past each page's num_tokens (no stale KV leaves the pool)."""
    for i, n in enumerate(num_tokens):
        if n < page_size:
            pages[i, :, :, n:] = 0


class KVCache:
    """Dense pool in the model dtype."""

    quantized = False

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        quant=torch_quant,
    ):
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.quant = quant  # .quantize / .dequantize with pdserve.kv.quant's signatures
        self.data = torch.zeros(2, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- attention path --------------------------------------------------------------------------------
    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer: K, V each [num_pages, page_size, kv_heads, head_dim] (for paged kernels)."""
        return self.data[0, layer], self.data[1, layer]

    def layer_pool(self, layer: int) -> tuple:
        """What the fused GPU write kernel (kernels/rope_kv_write.py) stores into: (K, V) views of one layer."""
        return self.layer_tensors(layer)

    def write(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slot_ids [T] long; k, v [T, kv_heads, head_dim] -> stored at those slots of `layer`."""
        flat = self.data[:, layer].view(2, -1, self.num_kv_heads, self.head_dim)  # [2, P*ps, kvh, d]
        flat[0].index_copy_(0, slot_ids, k.to(self.dtype))
        flat[1].index_copy_(0, slot_ids, v.to(self.dtype))

    def read(self, layer: int, page_ids, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """First `num_tokens` tokens of a sequence whose page table is `page_ids`: K, V [num_tokens, kvh, d]."""
        kv = self.data[:, layer, _ids(page_ids, self.device)]  # [2, n_pages, ps, kvh, d]
        kv = kv.reshape(2, -1, self.num_kv_heads, self.head_dim)[:, :num_tokens]
        return kv[0], kv[1]

    def gather(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [len(slot_ids), kvh, d] at arbitrary slots."""
        flat = self.data[:, layer].view(2, -1, self.num_kv_heads, self.head_dim)
        return flat[0][slot_ids], flat[1][slot_ids]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages `src` to `dst` (every layer, K and V; a quantized pool's scales and zero points too):
        a fork's own copy of its request's last, partial prompt page (copy-on-write)."""
        s, d = _ids(src, self.device), _ids(dst, self.device)
        for t in (self.data, getattr(self, "scales", None), getattr(self, "zeros", None)):
            if t is not None:  # [2, L, P, ps, kvh, d | G]
                view = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # no fp8 index kernels
                view[:, :, d] = view[:, :, s]

    # ---- page transfer ---------------------------------------------------------------------------------
    def import_page(self, physical_page: int, payload: PagePayload) -> None:
        """Write a payload (dense or int8) into `physical_page`; int8 payloads are dequantized."""
        self._check_payload(physical_page, payload)
        dense = self._payload_dense(payload, self.dtype)
        ls, n = payload.layer_start, payload.num_tokens
        self.data[:, ls : ls + dense.shape[1], physical_page, :n] = dense

    def _payload_dense(self, payload: PagePayload, dtype: torch.dtype, cast_dense: bool = True) -> torch.Tensor:
        """A checked payload's data on the pool's device: quantized dequantized to `dtype`, dense cast to `dtype`
        (or kept in its own dtype unless `cast_dense`)."""
        if payload.group_size == 0:
            return payload.data.to(self.device, dtype) if cast_dense else payload.data.to(self.device)
        assert payload.scales is not None  # _check_payload: a quantized payload carries scales
        zeros = None if payload.zeros is None else payload.zeros.to(self.device)
        return self.quant.dequantize(
            payload.data.to(self.device), payload.scales.to(self.device), zeros, payload.group_size, dtype
        )

    # ---- batches of whole pages (pdserve.kv.transfer) -------------------------------------------------------
    def _gather_dense(self, ids: torch.Tensor, layers: slice = _ALL) -> torch.Tensor:
        """[N, 2, L, ps, kvh, d] of the pages `ids` (L: the `layers` slice), model dtype (one gather)."""
        return self.data[:, layers].permute(2, 0, 1, 3, 4, 5)[ids]

    def gather_pages(
        self,
        page_ids: list[int],
        num_tokens: list[int],
        quantized: bool,
        group_size: int = 0,
        asymmetric: bool = False,
        dtype: torch.dtype | None = None,
        layers: tuple[int, int] | None = None,
        index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Whole pages, page-major, on the pool's device: data [N, 2, L, ps, kvh, d] (quantized: `dtype` int8 by
        default or float8_e4m3fn; dense: `dtype` or the model dtype), scales / zeros [N, 2, L, ps, kvh, d // group]
        float16 or None. Tokens past each page's `num_tokens` are zero. `layers` (start, stop): only those (L of
        them: a layer group's rows, the same values as the whole pages' at those layers). `index`: `page_ids` as a
        long tensor on the pool's device, made ahead (inside a forward, no host-to-device copy, so no host sync)."""
        self._check_pages(page_ids, num_tokens)
        ids = index if index is not None else _ids(page_ids, self.device)
        dense = self._gather_dense(ids, self._layer_slice(layers))
        _zero_tails(dense, num_tokens, self.page_size)
        if quantized:
            return self.quant.quantize(dense, group_size, asymmetric, dtype or torch.int8)
        return dense.to(dtype or self.dtype), None, None

    def scatter_pages(
        self,
        page_ids: list[int],
        data: torch.Tensor,
        scales: torch.Tensor | None,
        zeros: torch.Tensor | None,
        group_size: int,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Write whole pages (the layout of `gather_pages`: all layers, or the `layers` (start, stop) it names) into
        `page_ids`; quantized data (int8 or fp8, by its dtype) is dequantized."""
        sl = self._layer_slice(layers)
        self._check_batch(page_ids, data, scales, group_size, sl)
        if group_size > 0:
            dense = self.quant.dequantize(data, scales, zeros, group_size, self.dtype)
        else:
            dense = data.to(self.dtype)
        self.data[:, sl].permute(2, 0, 1, 3, 4, 5)[_ids(page_ids, self.device)] = dense

    def _layer_slice(self, layers: tuple[int, int] | None) -> slice:
        """The pool's layer axis slice of a batch: every layer, or [start, stop)."""
        if layers is None:
            return _ALL
        start, stop = layers
        if not 0 <= start < stop <= self.num_layers:
            raise InvalidRequest(f"layers [{start}, {stop}) outside the pool's {self.num_layers}")
        return slice(start, stop)

    def _check_batch(
        self, page_ids: list[int], data: torch.Tensor, scales: torch.Tensor | None, g: int, layers: slice = _ALL
    ) -> None:
        for p in page_ids:
            self._check_page(p, self.page_size)
        num_layers = len(range(self.num_layers)[layers])
        want = (len(page_ids), 2, num_layers, self.page_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != want:
            raise InvalidRequest(f"batch data shape {tuple(data.shape)} != {want}")
        if g > 0 and (scales is None or self.head_dim % g or tuple(scales.shape) != (*want[:-1], self.head_dim // g)):
            raise InvalidRequest(f"batch scales do not fit group_size {g}")

    # ---- validation ------------------------------------------------------------------------------------
    def _check_pages(self, page_ids: list[int], num_tokens: list[int]) -> None:
        for p, n in zip(page_ids, num_tokens):
            self._check_page(p, n)

    def _check_page(self, page: int, num_tokens: int) -> None:
        if not 0 <= page < self.num_pages:
            raise InvalidRequest(f"physical page {page} outside pool of {self.num_pages}")
        if not 0 < num_tokens <= self.page_size:
            raise InvalidRequest(f"num_tokens {num_tokens} not in 1..{self.page_size}")

    def check_payload(self, p: PagePayload) -> None:
        """Raise InvalidRequest unless `p` (dense, int8 or fp8, any group size) can be imported into this pool."""
        self._check_payload(0, p)

    def _check_payload(self, page: int, p: PagePayload) -> None:
        self._check_page(page, p.num_tokens)
        d = p.data
        if d.dim() != 5 or d.shape[0] != 2 or tuple(d.shape[2:]) != (p.num_tokens, self.num_kv_heads, self.head_dim):
            raise InvalidRequest(
                f"payload data shape {tuple(d.shape)} != [2, layers, {p.num_tokens}, "
                f"{self.num_kv_heads}, {self.head_dim}]"
            )
        if p.layer_start < 0 or p.layer_start + d.shape[1] > self.num_layers or d.shape[1] == 0:
            raise InvalidRequest(
                f"payload layers [{p.layer_start}, {p.layer_start + d.shape[1]}) outside [0, {self.num_layers})"
            )
        if p.group_size > 0:
            if d.dtype not in QUANTIZED_DTYPES:
                raise InvalidRequest(f"quantized payload data must be int8 or float8_e4m3fn, got {d.dtype}")
            if d.dtype != torch.int8 and p.zeros is not None:
                raise InvalidRequest(f"{d.dtype} payload has zero points (symmetric only)")
            if self.head_dim % p.group_size:
                raise InvalidRequest(f"payload group_size {p.group_size} does not divide head_dim {self.head_dim}")
            want = (*d.shape[:-1], self.head_dim // p.group_size)
            if p.scales is None or tuple(p.scales.shape) != want:
                raise InvalidRequest(
                    f"payload scales shape {None if p.scales is None else tuple(p.scales.shape)} != {want}"
                )
            if p.zeros is not None and tuple(p.zeros.shape) != want:
                raise InvalidRequest(f"payload zeros shape {tuple(p.zeros.shape)} != {want}")
        elif not d.is_floating_point() or d.dtype in QUANTIZED_DTYPES:
            raise InvalidRequest(f"unquantized payload must be a dense floating point dtype, got {d.dtype}")


class QuantizedKVCache(KVCache):
    """Quantized pool: `storage` int8 (per-group fp16 scales, + fp16 zero points if asymmetric) or float8_e4m3fn
    (per-group fp16 scales, symmetric); dequantizes on read."""

    quantized = True

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        group_size: int,
        asymmetric: bool,
        quant=torch_quant,
        storage: torch.dtype = torch.int8,
    ):
        if head_dim % group_size:
            raise ValueError(f"kv group_size {group_size} does not divide head_dim {head_dim}")
        if storage not in QUANTIZED_DTYPES:
            raise ValueError(f"quantized pool storage must be int8 or float8_e4m3fn, got {storage}")
        if asymmetric and storage != torch.int8:
            raise ValueError(f"{storage} KV is symmetric only")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device  # dtype: what reads dequantize to (the model dtype)
        self.quant = quant
        self.group_size, self.asymmetric, self.storage = group_size, asymmetric, storage
        shape = (2, num_layers, num_pages, page_size, num_kv_heads)
        self.data = torch.zeros(*shape, head_dim, dtype=storage, device=device)
        self.scales = torch.ones(*shape, head_dim // group_size, dtype=torch.float16, device=device)
        self.zeros = torch.zeros_like(self.scales) if asymmetric else None

    @staticmethod
    def int8_bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, group_size: int, asymmetric: bool
    ) -> int:
        """Bytes of one int8 (or fp8: also one byte per value) page: data, scales and (asymmetric) zero points, all
        layers, K and V."""
        per_token = head_dim + (2 if asymmetric else 1) * 2 * (head_dim // group_size)
        return 2 * num_layers * page_size * num_kv_heads * per_token

    def layer_tensors(self, layer: int):
        raise NotImplementedError("quantized pool has no dense per-layer view; use gather()/read()")

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One layer: data [2, P, ps, kvh, d] int8 | fp8, scales (and zeros or None) [2, P, ps, kvh, d // g] fp16."""
        return self.data[:, layer], self.scales[:, layer], None if self.zeros is None else self.zeros[:, layer]

    def layer_pool(self, layer: int) -> tuple:
        """(K, V, K scales, V scales, K zeros | None, V zeros | None) of one layer, for kernels/rope_kv_write.py
        (K, V int8 or float8_e4m3fn: the kernel quantizes to their dtype)."""
        d, s, z = self.layer_views(layer)
        return d[0], d[1], s[0], s[1], None if z is None else z[0], None if z is None else z[1]

    def _dequant(self, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        return self.quant.dequantize(q, s, z, self.group_size, self.dtype)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.quant.quantize(x, self.group_size, self.asymmetric, self.storage)

    def same_format(self, group_size: int, asymmetric: bool, dtype: torch.dtype | None) -> bool:
        """Whether quantized data of this format is the pool's own (copied straight, no requantization)."""
        return group_size == self.group_size and asymmetric == self.asymmetric and (dtype or torch.int8) == self.storage

    def write(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        q, s, z = self._quantize(torch.stack([k, v]))  # [2, T, kvh, d|G]
        for dst, src in ((self.data, q), (self.scales, s), (self.zeros, z)):
            if dst is not None and src is not None:
                if dst.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
                    dst, src = dst.view(torch.uint8), src.view(torch.uint8)
                dst[:, layer].view(2, -1, *dst.shape[-2:]).index_copy_(1, slot_ids, src)

    def _select(
        self, layer: int, index: torch.Tensor, by_page: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(data, scales, zeros | None) of one layer at pages (`by_page`) or slots `index`, [2, N, kvh, d | G]."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            x = t[:, layer]
            return x[:, index].reshape(2, -1, *t.shape[-2:]) if by_page else x.reshape(2, -1, *t.shape[-2:])[:, index]

        return pick(self.data), pick(self.scales), None if self.zeros is None else pick(self.zeros)

    def read(self, layer: int, page_ids, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, s, z = self._select(layer, _ids(page_ids, self.device), by_page=True)
        kv = self._dequant(q[:, :num_tokens], s[:, :num_tokens], None if z is None else z[:, :num_tokens])
        return kv[0], kv[1]

    def gather(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._dequant(*self._select(layer, slot_ids, by_page=False))
        return kv[0], kv[1]

    def _gather_quantized(
        self, ids: torch.Tensor, layers: slice = _ALL
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [N, 2, L, ps, kvh, d], scales / zeros (or None) [N, 2, L, ps, kvh, d // g] of the pages `ids`."""

        def pages(t: torch.Tensor) -> torch.Tensor:
            return t[:, layers].permute(2, 0, 1, 3, 4, 5)[ids]

        return pages(self.data), pages(self.scales), None if self.zeros is None else pages(self.zeros)

    def _gather_dense(self, ids: torch.Tensor, layers: slice = _ALL) -> torch.Tensor:
        return self._dequant(*self._gather_quantized(ids, layers))

    def gather_pages(
        self,
        page_ids: list[int],
        num_tokens: list[int],
        quantized: bool,
        group_size: int = 0,
        asymmetric: bool = False,
        dtype: torch.dtype | None = None,
        layers: tuple[int, int] | None = None,
        index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if not (quantized and self.same_format(group_size, asymmetric, dtype)):
            return super().gather_pages(page_ids, num_tokens, quantized, group_size, asymmetric, dtype, layers, index)
        self._check_pages(page_ids, num_tokens)
        ids = index if index is not None else _ids(page_ids, self.device)
        q, s, z = self._gather_quantized(ids, self._layer_slice(layers))  # straight copy
        for t in (q, s, z):
            if t is not None:
                _zero_tails(t, num_tokens, self.page_size)
        return q, s, z

    def scatter_pages(
        self,
        page_ids: list[int],
        data: torch.Tensor,
        scales: torch.Tensor | None,
        zeros: torch.Tensor | None,
        group_size: int,
        layers: tuple[int, int] | None = None,
    ) -> None:
        sl = self._layer_slice(layers)
        self._check_batch(page_ids, data, scales, group_size, sl)
        ids = _ids(page_ids, self.device)
        if group_size > 0 and self.same_format(group_size, zeros is not None, data.dtype):  # straight copy
            q, s, z = data, scales, zeros
        else:
            dense = self.quant.dequantize(data, scales, zeros, group_size, torch.float32) if group_size > 0 else data
            q, s, z = self._quantize(dense.to(self.device))
        for dst, src in ((self.data, q), (self.scales, s), (self.zeros, z)):
            if dst is not None:
                assert src is not None  # _check_batch: int8 input has scales; zeros present iff the pool's are
                dst[:, sl].permute(2, 0, 1, 3, 4, 5)[ids] = src.to(self.device)

    def import_page(self, physical_page: int, payload: PagePayload) -> None:
        self._check_payload(physical_page, payload)
        ls, n, nl = payload.layer_start, payload.num_tokens, payload.data.shape[1]
        sl = (slice(None), slice(ls, ls + nl), physical_page, slice(0, n))
        if payload.quantized and self.same_format(payload.group_size, payload.zeros is not None, payload.data.dtype):
            q, s, z = payload.data, payload.scales, payload.zeros  # straight copy
        else:
            dense = self._payload_dense(payload, torch.float32, cast_dense=False)
            q, s, z = self._quantize(dense)
        assert s is not None  # same format: the pool's quantized layout, scales included
        self.data[sl] = q.to(self.device)
        self.scales[sl] = s.to(self.device)
        if self.zeros is not None:
            assert z is not None  # same format means zeros present iff the pool is asymmetric
            self.zeros[sl] = z.to(self.device)


Int8KVCache = QuantizedKVCache  # the int8 pool (storage=torch.int8, the default); fp8: storage=torch.float8_e4m3fn
