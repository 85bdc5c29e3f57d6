"""Attention over the paged KV pool: batch metadata and two backends (FlashAttention-3, torch SDPA).

A forward batch holds, per sequence, `q_len` new tokens at positions `start .. start+q_len-1`; the new K/V
are first written to the pool, then query i (absolute position start+i) attends to keys 0..start+i.
A mixed step (scheduler.py) puts `num_decode` decode rows (one token each) before the prefill chunks: the model's
linear layers run once over all rows, and FA3Backend attends the two parts separately (`AttentionMetadata.split`),
decode rows through the decode kernels (int8 / fp8 / dense Triton or FA3 decode), prefill rows through the prefill
path, so a long decode context never enters the prefill's dequantized scratch. SdpaBackend attends one sequence at
a time anyway: a decode row there is the same call a pure decode step makes.
A backend only attends (`attend`): the model stores this step's K/V in the pool first (`KernelChoice.rope_and_store`).
The backend is chosen once at start-up (`select_backend`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine.fa3_call import FA3Forward
from pdserve.engine.host_to_device import to_device
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.kv_cache import KVCache

log = logging.getLogger("pdserve.engine")

INVARIANT_SPLITS = 4  # batch_invariant on CUDA: split-K count of every attention row (RowwiseTritonBackend)


def int8_launch_config(
    default: dict, tile_launch: dict, overrides: dict, head_dim: int, groups: int, asymmetric: bool
) -> dict:
    """The Triton int8 decode kernel's config for one pool: `default` with `overrides` where the lean loop reads the
    pool (symmetric, two scale groups per head, head_dim >= 128 and a multiple of 8: the shapes
    `int8_decode_attention.reads_planes` names); for any other int8 pool, `tile_launch`'s block / warps / stages
    under the overrides (the one-warp launch suits the lean loop's narrow dots only)."""
    planes = not asymmetric and groups == 2 and head_dim >= 128 and head_dim % 8 == 0
    return {**default, **overrides} if planes else {**default, **tile_launch, **overrides}


@dataclass
class AttentionMetadata:
    starts: list[int]  # per sequence: tokens already in the pool before this step
    q_lens: list[int]  # per sequence: new tokens this step
    page_tables: list[list[int]]  # per sequence: physical pages (covering start + q_len tokens)
    page_size: int
    device: torch.device
    num_decode: int = 0  # the first num_decode sequences are decode rows (q_len 1) of a mixed step
    _rows: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)  # (positions, slots)
    _page_ids: list[torch.Tensor] | None = field(init=False, default=None)
    _fa3: dict = field(init=False, default_factory=dict)  # lazily built int32 tensors for FA3
    _split: tuple[AttentionMetadata, AttentionMetadata] | None = field(init=False, default=None)

    def _row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None:
            ps = self.page_size
            pos: list[int] = []
            slots: list[int] = []
            for start, n, table in zip(self.starts, self.q_lens, self.page_tables):
                p = list(range(start, start + n))
                pos.extend(p)
                slots.extend(table[i // ps] * ps + i % ps for i in p)
            self._rows = (to_device(pos, torch.long, self.device), to_device(slots, torch.long, self.device))
        return self._rows

    @property
    def positions(self) -> torch.Tensor:
        """[T] long: the position of each new token."""
        return self._row_tensors()[0]

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[T] long: page * page_size + offset of each new token."""
        return self._row_tensors()[1]

    @property
    def is_mixed(self) -> bool:
        """Decode rows and prefill rows in one step (attended apart by FA3Backend)."""
        return 0 < self.num_decode < self.num_seqs

    def split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """(the decode rows' metadata, the prefill rows') of a mixed step; built once per step."""
        if self._split is None:
            d, ps, dev = self.num_decode, self.page_size, self.device
            self._split = (
                AttentionMetadata(self.starts[:d], self.q_lens[:d], self.page_tables[:d], ps, dev, d),
                AttentionMetadata(self.starts[d:], self.q_lens[d:], self.page_tables[d:], ps, dev),
            )
        return self._split

    @property
    def page_ids(self) -> list[torch.Tensor]:
        """Per sequence [n_pages] long: the pages holding its keys (built on first use: the SDPA path)."""
        if self._page_ids is None:
            ps = self.page_size
            self._page_ids = [
                to_device(t[: -(-self.kv_len(i) // ps)], torch.long, self.device)
                for i, t in enumerate(self.page_tables)
            ]
        return self._page_ids

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    def kv_len(self, i: int) -> int:
        return self.starts[i] + self.q_lens[i]

    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query row as a decode row: (seqlens [T] int32: position + 1, page_table [T, max_pages] int32: its
        sequence's row of `fa3_tensors()["page_table"]`)."""
        table = self.fa3_tensors()["page_table"]
        seq_of_row = torch.repeat_interleave(  # output_size given: no device-to-host read of the repeats' sum
            torch.arange(self.num_seqs, device=table.device),
            to_device(self.q_lens, torch.long, table.device),
            output_size=sum(self.q_lens),
        )
        return (self.positions + 1).to(torch.int32), table[seq_of_row]

    def fa3_tensors(self) -> dict:
        """cu_seqlens_q/k, cache_seqlens [B] (keys per sequence), page_table [B, max_pages], maxima."""
        if not self._fa3:
            kv = [self.kv_len(i) for i in range(self.num_seqs)]
            ps = self.page_size
            n_pages = [-(-n // ps) for n in kv]
            max_pages = max(n_pages)
            table = torch.zeros(self.num_seqs, max_pages, dtype=torch.int32)
            for i, (t, n) in enumerate(zip(self.page_tables, n_pages)):
                table[i, :n] = torch.tensor(t[:n], dtype=torch.int32)
            table = (
                table.pin_memory().to(self.device, non_blocking=True)
                if self.device.type == "cuda"
                else table.to(self.device)
            )
            cu_q = to_device([0] + self.q_lens, torch.int32, self.device).cumsum(0, dtype=torch.int32)
            cu_k = to_device([0] + kv, torch.int32, self.device).cumsum(0, dtype=torch.int32)
            self._fa3 = dict(
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                cache_seqlens=to_device(kv, torch.int32, self.device),
                page_table=table,
                max_q=max(self.q_lens),
                max_k=max(kv),
            )
        return self._fa3


class SdpaBackend:
    """torch scaled_dot_product_attention, one sequence at a time over its gathered pages (CPU, any GPU).

    `row_wise` (EngineConfig.batch_invariant): a prefill chunk attends one query row at a time, each over exactly
    its keys 0..p without a mask, the very call a decode step at position p makes; so a token's attention output
    does not depend on how its prompt was chunked (batch mates' share of the chunk budget, prompt-cache hits) or on
    whether it was prefilled or decoded."""

    name = "sdpa"

    def __init__(self, row_wise: bool = False):
        self.row_wise = row_wise

    def attend(
        self, layer: int, q: torch.Tensor, meta: AttentionMetadata, cache: KVCache, scale: float
    ) -> torch.Tensor:
        """q [T, H, D] against the pool (this step's K/V already written) -> out [T, H, D]."""
        out = torch.empty_like(q)
        n_rep = q.shape[1] // cache.num_kv_heads
        qs = 0
        for i in range(meta.num_seqs):
            start, n, kv_len = meta.starts[i], meta.q_lens[i], meta.kv_len(i)
            ks, vs = cache.read(layer, meta.page_ids[i], kv_len)  # [kv_len, KVH, D]
            if n_rep > 1:
                ks, vs = ks.repeat_interleave(n_rep, dim=1), vs.repeat_interleave(n_rep, dim=1)
            qi = q[qs : qs + n].transpose(0, 1)  # [H, n, D]
            if self.row_wise and n > 1:
                kt, vt = ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype)  # [H, kv_len, D]
                for j in range(n):
                    kv = start + j + 1
                    o = F.scaled_dot_product_attention(qi[:, j : j + 1], kt[:, :kv], vt[:, :kv], scale=scale)
                    out[qs + j] = o[:, 0]
                qs += n
                continue
            mask = None
            if n > 1:  # query j (position start+j) sees keys 0..start+j
                mask = (
                    torch.arange(kv_len, device=q.device)[None, :]
                    <= torch.arange(start, start + n, device=q.device)[:, None]
                )  # [n, kv_len]
            o = F.scaled_dot_product_attention(
                qi, ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale
            )  # [H, n, D]
            out[qs : qs + n] = o.transpose(0, 1)
            qs += n
        return out


class FA3Backend:
    """FlashAttention-3 (Hopper) over the paged pool, through `flash_attn_with_kvcache` with the page table:
    decode (one query per sequence) and prefill chunks (varlen queries, causal mask aligned bottom-right, which
    is exactly "query i attends to keys 0..start+i").

    Quantized pools (int8, fp8): prefill chunks dequantize the batch's pages into a dense scratch (one Triton pass)
    that FA3 then reads. Decode has two kernels (`KernelChoice.int8_decode`, for both formats): "triton" reads the
    quantized pages directly, dequantizing in registers (pdserve.engine.kernels.int8_decode_attention, and
    fp8_decode_attention for an fp8 pool); "dequant" dequantizes to a scratch, then FA3. Dense pool decode
    (`dense_decode`): FA3's paged kernel or the same Triton kernel reading bf16 pages.
    The defaults ("triton" for both) read the pool once, at its own width: dequantizing first moves 1 + 2 + 2
    bytes per element, and for bf16 pages the Triton kernel's split layout suits decode batches better than FA3's."""

    name = "fa3"

    def __init__(self, module, kernels: KernelChoice):
        self.fa = FA3Forward(module)  # the op itself where its schema allows (pdserve.engine.fa3_call)
        self.kernels = kernels  # decode/prefill kernel choices, FA3 splits, Triton decode config, PDL
        self._num_sms = 0

    def attend(self, layer: int, q: torch.Tensor, meta, cache: KVCache, scale: float) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]. `meta` is an AttentionMetadata or a CUDA-graph StaticDecodeMeta (only
        `is_mixed`, `is_decode` and `fa3_tensors()` are used, so the call is graph-safe for decode). A mixed step's
        decode rows (the first `meta.num_decode`) go through the decode kernels, its prefill rows through the
        prefill path."""
        if meta.is_mixed:
            decode, prefill = meta.split()
            d = meta.num_decode
            return torch.cat(
                [self._attend(layer, q[:d], decode, cache, scale), self._attend(layer, q[d:], prefill, cache, scale)]
            )  # [T, H, D]
        return self._attend(layer, q, meta, cache, scale)

    def _attend(self, layer: int, q: torch.Tensor, meta, cache: KVCache, scale: float) -> torch.Tensor:
        """q [T, H, D] of rows all decode (`meta.is_decode`) or a prefill batch -> out [T, H, D]."""
        kc = self.kernels
        t = meta.fa3_tensors()
        seqlens, table = t["cache_seqlens"], t["page_table"]
        if meta.is_decode:
            if kc.int8_decode == "triton" if cache.quantized else kc.dense_decode == "triton":
                return self._triton_decode(layer, q, cache, table, seqlens, scale)
            if cache.quantized:  # dequantize the batch's pages, then FA3 over the scratch as a paged cache
                kv = self._dense_scratch(layer, cache, table, seqlens, q.dtype)  # [2, B, W * ps, KVH, D]
                b, w = table.shape
                k_cache, v_cache = (x.view(b * w, cache.page_size, *kv.shape[-2:]) for x in kv)
                table = torch.arange(b * w, dtype=torch.int32, device=q.device).view(b, w)
            else:
                k_cache, v_cache = cache.layer_tensors(layer)  # [P, ps, KVH, D]
            out = self.fa.with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, seqlens, table, scale, causal=True, num_splits=kc.fa3_num_splits
            )
            return out.squeeze(1)
        if not cache.quantized and kc.dense_prefill == "paged":
            k_cache, v_cache = cache.layer_tensors(layer)
            return self.fa.with_kvcache(
                q, k_cache, v_cache, seqlens, table, scale, causal=True, cu_seqlens_q=t["cu_seqlens_q"],
                max_seqlen_q=t["max_q"],
            )  # fmt: skip
        # contiguous K/V per sequence ([B, W * ps] tokens, the first seqlens[b] valid) -> varlen FA3
        kv = self._dense_scratch(layer, cache, table, seqlens, q.dtype)
        b, n = kv.shape[1], kv.shape[2]
        cu_k = t.get("cu_seqlens_scratch")  # the same for every layer of the step: made once
        if cu_k is None:
            cu_k = t["cu_seqlens_scratch"] = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
        k, v = (x.view(b * n, *kv.shape[-2:]) for x in kv)
        return self.fa.varlen(q, k, v, t["cu_seqlens_q"], cu_k, t["max_q"], n, seqlens, scale, causal=True)

    @staticmethod
    def _dense_scratch(
        layer: int, cache, table: torch.Tensor, seqlens: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The batch's pages as dense K/V [2, B, W * ps, KVH, D]: quantized pools dequantized by one Triton pass
        (tokens past seqlens[b] unwritten), dense pools gathered (tokens past seqlens[b] are other pages)."""
        if cache.quantized:
            from pdserve.engine.kernels.kv_gather import dequant_pages

            data, scales, zeros = cache.layer_views(layer)
            return dequant_pages(data, scales, zeros, table, seqlens, dtype)
        k_cache, v_cache = cache.layer_tensors(layer)
        b, w = table.shape
        ps = cache.page_size
        slots = (table.long()[:, :, None] * ps + torch.arange(ps, device=table.device)).view(-1)  # [B * W * ps]
        kv = torch.stack([k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]])
        return kv.view(2, b, w * ps, *kv.shape[-2:])

    def _num_splits(self, batch: int, kv_heads: int, split_mult: int) -> int:
        """Split-K count of the Triton decode kernel: about `split_mult` waves for this batch size."""
        from pdserve.engine.kernels.paged_decode_common import default_num_splits

        return default_num_splits(batch, kv_heads, self._num_sms, split_mult)

    def _triton_decode(
        self, layer: int, q: torch.Tensor, cache, table: torch.Tensor, seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        from pdserve.engine.kernels import int8_decode_attention as kd

        if not self._num_sms:
            self._num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        if cache.quantized and cache.data.dtype == torch.float8_e4m3fn:
            return self._fp8_decode(layer, q, cache, table, seqlens, scale)
        kc = self.kernels
        if cache.quantized:
            data, scales, zeros = cache.layer_views(layer)
            cfg = int8_launch_config(
                kd.DEFAULT_CONFIG, kd.TILE_LAUNCH, kc.decode_config, q.shape[-1], scales.shape[-1], zeros is not None
            )
        else:
            cfg = {**kd.DENSE_CONFIG, **kc.decode_config}
        splits = self._num_splits(q.shape[0], cache.num_kv_heads, cfg["split_mult"])
        kw = dict(block_n=cfg["block_n"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], pdl=kc.pdl)
        if not cache.quantized:
            k_cache, v_cache = cache.layer_tensors(layer)
            return kd.int8_paged_decode(
                q, k_cache, v_cache, None, None, None, None, table, seqlens, scale, splits, **kw
            )
        return kd.int8_paged_decode(
            q,
            data[0],
            data[1],
            scales[0],
            scales[1],
            None if zeros is None else zeros[0],
            None if zeros is None else zeros[1],
            table,
            seqlens,
            scale,
            splits,
            **kw,
        )

    def _fp8_decode(
        self, layer: int, q: torch.Tensor, cache, table: torch.Tensor, seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Decode over an fp8 pool with the Triton kernel that reads its pages (kernels/fp8_decode_attention.py);
        `decode_kernel_config` overrides block_n / num_warps / num_stages / split_mult as for int8."""
        from pdserve.engine.kernels import fp8_decode_attention as kf

        kc = self.kernels
        cfg = {**kf.FP8_CONFIG, **{k: v for k, v in kc.decode_config.items() if k in kf.FP8_CONFIG}}
        splits = self._num_splits(q.shape[0], cache.num_kv_heads, cfg["split_mult"])
        data, scales, _ = cache.layer_views(layer)
        return kf.fp8_paged_decode(
            q,
            data[0],
            data[1],
            scales[0],
            scales[1],
            table,
            seqlens,
            scale,
            splits,
            block_n=cfg["block_n"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            pdl=kc.pdl,
        )


class RowwiseTritonBackend(FA3Backend):
    """`batch_invariant` on CUDA: every query row, prefill or decode, attends through the Triton paged decode
    kernel (the pool's format: int8, fp8 or dense) as one row over exactly its keys 0..p, with a fixed split
    count. A prompt token's attention output is then the very call a decode step at that position makes, and
    depends neither on its batch mates, nor on how its prompt was chunked, nor on whether its prefix came from
    the prompt cache (the prefill then stores the shipped format: services/prefill/server.py). Prefill pays for
    it: each row reads its whole prefix, several times the time of a chunked FA3 prefill. FA3 is not used."""

    name = "triton-rows"

    def __init__(self, kernels: KernelChoice):
        super().__init__(None, kernels)

    def _num_splits(self, batch: int, kv_heads: int, split_mult: int) -> int:
        """A constant: a row's split boundaries, and so its sums, depend on its own length alone."""
        return INVARIANT_SPLITS

    def attend(self, layer: int, q: torch.Tensor, meta, cache: KVCache, scale: float) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]; graph-safe for decode like FA3Backend.attend."""
        t = meta.fa3_tensors()
        if meta.is_decode:
            return self._triton_decode(layer, q, cache, t["page_table"], t["cache_seqlens"], scale)
        seqlens, table = meta.row_tensors()
        return self._triton_decode(layer, q, cache, table, seqlens, scale)


def _probe_fa3(device: torch.device, dtype: torch.dtype) -> tuple[object | None, str]:
    if device.type != "cuda":
        return None, f"device is {device.type}, FA3 needs CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return None, f"GPU is sm{major}{minor}, FA3 needs sm90 (Hopper)"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"dtype {dtype} unsupported by FA3 (needs float16/bfloat16)"
    try:
        import flash_attn_interface as fa
    except Exception as e:
        return None, f"flash_attn_interface not importable ({type(e).__name__}: {e})"
    return fa, "CUDA sm90, flash_attn_interface importable"


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, kernels: KernelChoice):
    """Return (backend, reason). `requested` is auto|fa3|sdpa; an explicit fa3 that cannot run raises.
    `kernels`: FA3's kernel choices (see FA3Backend)."""
    if kernels.invariant_gemm:  # batch_invariant on CUDA
        return RowwiseTritonBackend(kernels), "batch_invariant"
    row_wise = kernels.invariant_rows > 0  # batch_invariant on CPU
    if requested == "sdpa" or row_wise:
        return SdpaBackend(row_wise), "requested" if requested == "sdpa" else "batch_invariant"
    fa, reason = _probe_fa3(device, dtype)
    if fa is not None:
        return FA3Backend(fa, kernels), reason
    if requested == "fa3":
        raise RuntimeError(f"attention_backend=fa3 requested but unavailable: {reason}")
    return SdpaBackend(), reason
