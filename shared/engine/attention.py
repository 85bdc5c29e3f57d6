"""Attention over the paged KV pool: batch metadata and two backends (FlashAttention-3, torch SDPA).

A forward batch holds, per sequence, `q_len` new tokens at positions `start .. start+q_len-1`; the new K/V
are first written to the pool, then query i (absolute position start+i) attends to keys 0..start+i.
The backend is chosen once at start-up (`select_backend`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine.kv_cache import KVCache

log = logging.getLogger("pdserve.engine")


@dataclass
class AttentionMetadata:
    starts: list[int]                 # per sequence: tokens already in the pool before this step
    q_lens: list[int]                 # per sequence: new tokens this step
    page_tables: list[list[int]]      # per sequence: physical pages (covering start + q_len tokens)
    page_size: int
    device: torch.device
    positions: torch.Tensor = field(init=False)      # [T] long
    slot_mapping: torch.Tensor = field(init=False)   # [T] long: page * page_size + offset of each new token
    page_ids: list[torch.Tensor] = field(init=False)  # per sequence [n_pages] long
    _fa3: dict = field(init=False, default_factory=dict)  # lazily built int32 tensors for FA3

    def __post_init__(self) -> None:
        ps = self.page_size
        pos, slots = [], []
        for start, n, table in zip(self.starts, self.q_lens, self.page_tables):
            p = list(range(start, start + n))
            pos.extend(p)
            slots.extend(table[i // ps] * ps + i % ps for i in p)
        self.positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.page_ids = [torch.tensor(t[: -(-self.kv_len(i) // ps)], dtype=torch.long, device=self.device)
                         for i, t in enumerate(self.page_tables)]

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    def kv_len(self, i: int) -> int:
        return self.starts[i] + self.q_lens[i]

    def fa3_tensors(self) -> dict:
        """cu_seqlens_q/k, cache_seqlens, page_table [B, max_pages], kv_slots (all keys per seq), maxima."""
        if not self._fa3:
            kv = [self.kv_len(i) for i in range(self.num_seqs)]
            i32 = dict(dtype=torch.int32, device=self.device)
            max_pages = max(len(t) for t in self.page_ids)
            table = torch.zeros(self.num_seqs, max_pages, **i32)
            for i, t in enumerate(self.page_ids):
                table[i, : len(t)] = t.to(torch.int32)
            cu_q = torch.tensor([0] + self.q_lens, **i32).cumsum(0, dtype=torch.int32)
            cu_k = torch.tensor([0] + kv, **i32).cumsum(0, dtype=torch.int32)
            ps = self.page_size
            kv_slots = torch.cat([(t[:, None] * ps + torch.arange(ps, device=self.device)).flatten()[:n]
                                  for t, n in zip(self.page_ids, kv)])
            self._fa3 = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, cache_seqlens=torch.tensor(kv, **i32),
                             page_table=table, kv_slots=kv_slots, max_q=max(self.q_lens), max_k=max(kv))
        return self._fa3


class SdpaBackend:
    """torch scaled_dot_product_attention, one sequence at a time over its gathered pages (CPU, any GPU)."""

    name = "sdpa"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (new tokens) -> out [T, H, D]."""
        cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        n_rep = q.shape[1] // k.shape[1]
        qs = 0
        for i in range(meta.num_seqs):
            start, n, kv_len = meta.starts[i], meta.q_lens[i], meta.kv_len(i)
            ks, vs = cache.read(layer, meta.page_ids[i], kv_len)  # [kv_len, KVH, D]
            if n_rep > 1:
                ks, vs = ks.repeat_interleave(n_rep, dim=1), vs.repeat_interleave(n_rep, dim=1)
            qi = q[qs:qs + n].transpose(0, 1)                   # [H, n, D]
            mask = None
            if n > 1:  # query j (position start+j) sees keys 0..start+j
                mask = (torch.arange(kv_len, device=q.device)[None, :]
                        <= torch.arange(start, start + n, device=q.device)[:, None])  # [n, kv_len]
            o = F.scaled_dot_product_attention(qi, ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype),
                                               attn_mask=mask, scale=scale)  # [H, n, D]
            out[qs:qs + n] = o.transpose(0, 1)
            qs += n
        return out


class FA3Backend:
    """FlashAttention-3 (Hopper). Decode over a dense pool: `flash_attn_with_kvcache` with the page table.
    Prefill chunks (and int8 pools): K/V gathered per sequence, then `flash_attn_varlen_func` with a causal
    mask aligned bottom-right, which is exactly "query i attends to keys 0..start+i"."""

    name = "fa3"

    def __init__(self, module):
        self.fa = module

    @staticmethod
    def _first(out):
        return out[0] if isinstance(out, tuple) else out

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, scale: float) -> torch.Tensor:
        cache.write(layer, meta.slot_mapping, k, v)
        t = meta.fa3_tensors()
        if meta.is_decode and not cache.quantized:
            k_cache, v_cache = cache.layer_tensors(layer)  # [P, ps, KVH, D]
            out = self.fa.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=t["cache_seqlens"],
                                                  page_table=t["page_table"], softmax_scale=scale, causal=True)
            return self._first(out).squeeze(1)
        ks, vs = cache.gather(layer, t["kv_slots"])  # [sum kv_len, KVH, D]
        out = self.fa.flash_attn_varlen_func(q, ks.to(q.dtype), vs.to(q.dtype), t["cu_seqlens_q"], t["cu_seqlens_k"],
                                             t["max_q"], t["max_k"], softmax_scale=scale, causal=True)
        return self._first(out)


def _probe_fa3(device: torch.device, dtype: torch.dtype) -> tuple[object | None, str]:
    if device.type != "cuda":
        return None, f"device is {device.type}, FA3 needs CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return None, f"GPU is sm{major}{minor}, FA3 needs sm90 (Hopper)"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"dtype {dtype} unsupported by FA3 (needs float16/bfloat16)"
    try:
        import flash_attn_interface as fa  # noqa: PLC0415 - optional GPU dependency
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA extension
        return None, f"flash_attn_interface not importable ({type(e).__name__}: {e})"
    return fa, "CUDA sm90, flash_attn_interface importable"


def select_backend(requested: str, device: torch.device, dtype: torch.dtype):
    """Return (backend, reason). `requested` is auto|fa3|sdpa; an explicit fa3 that cannot run raises."""
    if requested == "sdpa":
        return SdpaBackend(), "requested"
    fa, reason = _probe_fa3(device, dtype)
    if fa is not None:
        return FA3Backend(fa), reason
    if requested == "fa3":
        raise RuntimeError(f"attention_backend=fa3 requested but unavailable: {reason}")
    return SdpaBackend(), reason
