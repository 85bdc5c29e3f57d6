"""FlashAttention-3's forward called as its registered op, `torch.ops.flash_attn_3.fwd`, with the arguments
flash_attn_interface's `flash_attn_varlen_func` / `flash_attn_with_kvcache` pass it.

Why: those functions reach the op through an autograd Function and a Python `torch.library.custom_op`, whose
dispatch costs the engine thread more host time than the op itself, at every layer of every step run eagerly. A
prefill chunk's host time is close to its GPU time, so any contention on the engine process's CPU or GIL (a prefix
fetch, gRPC threads) leaves the GPU idle (docs/benchmarks.md has the profiles). The op is called only when its
schema has every argument this module names (checked once); else the interface functions run, as before.
"""

from __future__ import annotations

from typing import Any

import torch

# the op's keyword arguments this module passes (besides q, k, v): each must be in the op's schema
_USED = (
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "softmax_scale",
    "is_causal", "is_rotary_interleaved", "num_splits",
)  # fmt: skip


def direct_op(module: Any) -> Any | None:
    """`torch.ops.flash_attn_3.fwd` when loaded (importing flash_attn_interface registers it) and its schema
    takes every argument of _USED and returns (out, lse, ...), else None."""
    if module is None:
        return None
    try:
        op = torch.ops.flash_attn_3.fwd
        schema = op.default._schema
    except (AttributeError, RuntimeError):
        return None
    names = {a.name for a in schema.arguments}
    return op if set(_USED) <= names and len(schema.returns) >= 2 else None


def _last_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """What flash_attn_interface's `maybe_contiguous` does: a copy only where the last dim is strided."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


class FA3Forward:
    """FA3's two forwards the engine uses, through the op when `direct_op` allows, else through `module`
    (flash_attn_interface). `direct`: which one runs."""

    def __init__(self, module: Any, direct: bool = True):
        self.module = module
        self.op = direct_op(module) if direct else None

    @property
    def direct(self) -> bool:
        return self.op is not None

    def varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        seqused_k: torch.Tensor | None,
        softmax_scale: float,
        causal: bool,
    ) -> torch.Tensor:
        """`flash_attn_varlen_func`: q [Tq, H, D], k / v [Tk, KVH, D] -> out [Tq, H, D]."""
        if self.op is None:
            out = self.module.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                softmax_scale=softmax_scale, causal=causal,
            )  # fmt: skip
            return out[0] if isinstance(out, tuple) else out
        if v.stride(-1) != 1 and v.stride(-3) != 1:
            v = v.contiguous()
        return self.op(
            _last_contiguous(q), _last_contiguous(k), v, cu_seqlens_q=_last_contiguous(cu_seqlens_q),
            cu_seqlens_k=_last_contiguous(cu_seqlens_k), seqused_k=_last_contiguous(seqused_k),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, is_causal=causal,
            is_rotary_interleaved=True, num_splits=1,
        )[0]  # fmt: skip

    def with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        page_table: torch.Tensor,
        softmax_scale: float,
        causal: bool,
        cu_seqlens_q: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        num_splits: int = 0,
    ) -> torch.Tensor:
        """`flash_attn_with_kvcache` over a paged pool: q [B, 1, H, D] (decode) or [T, H, D] with cu_seqlens_q
        (varlen prefill rows), k_cache / v_cache [P, ps, KVH, D] -> out shaped like q."""
        if self.op is None:
            out = self.module.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
            )  # fmt: skip
            return out[0] if isinstance(out, tuple) else out
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        return self.op(
            _last_contiguous(q), k_cache, v_cache, cu_seqlens_q=_last_contiguous(cu_seqlens_q),
            seqused_k=_last_contiguous(cache_seqlens), max_seqlen_q=max_seqlen_q,
            page_table=_last_contiguous(page_table), softmax_scale=softmax_scale, is_causal=causal,
            is_rotary_interleaved=True, num_splits=num_splits,
        )[0]  # fmt: skip
