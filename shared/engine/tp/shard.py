"""One rank's slice of a full checkpoint's tensors, by HF name, as they stream in (before q/k/v and gate/up are
concatenated into `qkv_proj` / `gate_up_proj`, so each part is sliced on its own):

    q_proj   rows of the rank's query heads          (column parallel)
    k/v_proj rows of the rank's KV heads, copies where replicated (layout.py)
    o_proj   columns of the rank's query heads        (row parallel: partial sums, all-reduced after)
    gate/up  rows of the rank's FFN range             (column parallel)
    down     columns of the rank's FFN range          (row parallel)
    embed_tokens, lm_head: rows of the rank's vocabulary range (tied embeddings: the same slice)
    norms (and Qwen3's per-head q/k norms): whole

Biases follow their rows; a row-parallel projection's bias (o_proj, down_proj) stays on rank 0 only (zeros
elsewhere), so the all-reduce adds it once. FP8 scales follow their weight: per-channel scales ([N] / [N, 1]) take
the weight's rows (a column slice keeps them whole), per-tensor and input scales stay whole, 128x128 block scales
(`weight_scale_inv` [ceil(N/128), ceil(K/128)]) take the blocks of the weight's slice, which must start on a block
boundary and end on one (or at the matrix's end): otherwise a ValueError names the projection. Online FP8
(`quantization="fp8"`) quantizes the full tensor first, then slices, so every rank holds the exact TP=1 values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.loader import ModelConfig
from pdserve.engine.tp.layout import RankLayout, TPLayout

Segments = list[tuple[int, int]]  # [start, stop) index ranges, concatenated in order

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _head_segments(heads: Sequence[int], head_dim: int) -> Segments:
    """Rows of `heads` (in order) as ranges, consecutive heads merged."""
    segs: Segments = []
    for h in heads:
        a, b = h * head_dim, (h + 1) * head_dim
        if segs and segs[-1][1] == a:
            segs[-1] = (segs[-1][0], b)
        else:
            segs.append((a, b))
    return segs


def _take(t: torch.Tensor, dim: int, segs: Segments) -> torch.Tensor:
    """`t`'s ranges `segs` along `dim`, concatenated, as a new contiguous tensor (the full one can be freed)."""
    fp8 = t.dtype == torch.float8_e4m3fn
    src = t.view(torch.uint8) if fp8 else t  # cat has no float8 kernel everywhere: move the bytes
    out = torch.cat([src.narrow(dim, a, b - a) for a, b in segs], dim=dim).contiguous()
    return out.view(t.dtype) if fp8 else out


def _block_segments(segs: Segments, total: int, block: int, what: str) -> Segments:
    """The block-scale ranges of element ranges `segs` of a dimension of `total` elements; ValueError unless each
    starts on a block boundary and ends on one or at `total` (then it must be the last range)."""
    out: Segments = []
    for i, (a, b) in enumerate(segs):
        ends_ok = b % block == 0 or (b == total and i == len(segs) - 1)
        if a % block or not ends_ok:
            raise ValueError(
                f"{what}: tensor-parallel slice [{a}, {b}) of {total} does not fall on {block}-element FP8 block "
                "boundaries (block-scaled FP8 needs each rank's heads / FFN columns in whole 128 blocks; "
                "use a smaller tensor_parallel_size or a per-channel FP8 checkpoint)"
            )
        out.append((a // block, -(-b // block)))
    return out


class RankSharder:
    """`sharder(name, tensor)` -> the part of a full checkpoint tensor that `rank` holds (a new tensor, or `tensor`
    itself when held whole)."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, rank: int):
        self.cfg, self.layout = cfg, layout
        self.rank: RankLayout = layout.rank(rank)
        block = cfg.quantization.block_size if cfg.quantization is not None else None
        self.block = block or (128, 128)
        d, r = cfg.head_dim, self.rank
        ffn = [r.ffn]
        # projection -> (its rows' or columns' ranges in this rank, the full extent of that dimension)
        self.rows: dict[str, tuple[Segments, int]] = {
            "q_proj": (_head_segments(range(*r.q_heads), d), cfg.num_heads * d),
            "k_proj": (_head_segments(r.kv_heads, d), cfg.num_kv_heads * d),
            "v_proj": (_head_segments(r.kv_heads, d), cfg.num_kv_heads * d),
            "gate_proj": (ffn, cfg.intermediate_size),
            "up_proj": (ffn, cfg.intermediate_size),
        }
        self.columns: dict[str, tuple[Segments, int]] = {
            "o_proj": (_head_segments(range(*r.q_heads), d), cfg.num_heads * d),
            "down_proj": (ffn, cfg.intermediate_size),
        }

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.layout.tp_size == 1:
            return t
        if name in _VOCAB:
            return _take(t, 0, [self.rank.vocab])
        parts = name.rsplit(".", 2)
        if len(parts) != 3:
            return t
        _, proj, kind = parts
        if proj in _COLUMN_PARALLEL:
            return self._column_parallel(name, proj, kind, t)
        if proj in _ROW_PARALLEL:
            return self._row_parallel(name, proj, kind, t)
        return t  # norms

    def _column_parallel(self, name: str, proj: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        segs, total = self.rows[proj]
        if kind in ("weight", "bias"):
            return _take(t, 0, segs)
        if kind == "weight_scale_inv":  # block scales [ceil(N/bn), ceil(K/bk)]
            return _take(t, 0, _block_segments(segs, total, self.block[0], name))
        if kind == "weight_scale" and t.numel() > 1:  # per channel [N] / [N, 1]
            return _take(t, 0, segs)
        return t  # per-tensor weight scale, input_scale

    def _row_parallel(self, name: str, proj: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        segs, total = self.columns[proj]
        if kind == "weight":
            return _take(t, 1, segs)
        if kind == "bias":  # added once: by rank 0's partial sum
            return t if self.rank.rank == 0 else torch.zeros_like(t)
        if kind == "weight_scale_inv":
            return _take(t, 1, _block_segments(segs, total, self.block[1], name))
        return t  # per-channel scales follow the (whole) output rows; per-tensor / input scales whole
