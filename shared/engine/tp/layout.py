"""Tensor-parallel layout: which heads, vocabulary rows and FFN columns each rank of a TP group holds (integers only,
no torch: the launcher can validate a `--tensor-parallel-size` without loading anything).

Rules (N = tp size, H query heads, KVH KV heads, group g = H / KVH query heads per KV head):
- Query heads: H % N == 0 is required; rank r holds the contiguous heads [r * H/N, (r + 1) * H/N).
- KV heads: each rank holds, for its query heads, the KV heads they read, as `kv_per_rank` local KV heads (the same
  count on every rank, so every rank's pool and kernels have one shape) with a uniform local group: local query head
  j reads local KV head j // (H/N / kv_per_rank), which is the global KV head of global query head r * H/N + j.
  `kv_per_rank` is the fewest that makes this hold on every rank: KVH / N when N divides KVH (a plain split, no
  copies); 1 when KVH divides N (each KV head replicated on N / KVH ranks); otherwise more than needed, some KV
  heads held twice on one rank (e.g. H=6, KVH=2, N=3: every rank holds 2 KV heads, [0, 0], [0, 1], [1, 1]).
  A replicated KV head's K/V are computed and stored by each rank that holds it.
- Vocabulary (embedding and LM head rows): shards of ceil(V / N) rows, the last one shorter (possibly empty);
  logits are gathered as N padded shards of ceil(V / N) columns and cut back to V.
- FFN (gate/up rows, down columns): N contiguous ranges of the intermediate size, as even as whole `granule`s allow
  (the granule is 128 for 128x128 block-scaled FP8 checkpoints, whose block scales must not straddle a shard
  boundary; 1 otherwise).
Block-scaled FP8 also needs every query/KV head range to start on a 128-row boundary: `shard.py` checks each slice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.loader import ModelConfig

MAX_TP_SIZE = 64  # one host's GPUs (8 today); a bound on the layout's integer work and on bad input


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds. Ranges are [start, stop) in global indices."""

    rank: int
    q_heads: tuple[int, int]  # global query heads
    kv_heads: tuple[int, ...]  # global KV head of each local KV head (repeats where replicated on this rank)
    vocab: tuple[int, int]  # embedding / LM head rows
    ffn: tuple[int, int]  # intermediate columns (gate/up rows, down_proj columns)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def ffn_size(self) -> int:
        return self.ffn[1] - self.ffn[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


@dataclass(frozen=True)
class TPLayout:
    """The whole group's layout (`make_layout`)."""

    tp_size: int
    vocab_size: int
    vocab_shard: int  # ceil(V / N): the padded width of each rank's logits shard in the all-gather
    kv_per_rank: int
    ranks: tuple[RankLayout, ...]

    def rank(self, r: int) -> RankLayout:
        if not 0 <= r < self.tp_size:
            raise ValueError(f"rank {r} outside the TP group of {self.tp_size}")
        return self.ranks[r]

    @property
    def replicated_kv(self) -> bool:
        """Whether some KV head is held by more than one rank (or twice on one)."""
        return sum(r.num_kv_heads for r in self.ranks) > len({h for r in self.ranks for h in r.kv_heads})


def _split(total: int, parts: int, granule: int) -> list[tuple[int, int]]:
    """[0, total) in `parts` contiguous ranges, boundaries on multiples of `granule` (or at `total`), as even as
    whole granules allow."""
    units = -(-total // granule)
    bounds = [min(total, (p * units // parts) * granule) for p in range(parts + 1)]
    return [(bounds[p], bounds[p + 1]) for p in range(parts)]


def _kv_heads_of(q_start: int, q_count: int, group: int, kv_count: int) -> tuple[int, ...] | None:
    """Global KV heads of `kv_count` local KV heads serving query heads [q_start, q_start + q_count) with a
    uniform local group, or None when some local group would span two global KV heads."""
    local_group = q_count // kv_count
    heads = []
    for i in range(kv_count):
        first, last = q_start + i * local_group, q_start + (i + 1) * local_group - 1
        if first // group != last // group:
            return None
        heads.append(first // group)
    return tuple(heads)


def make_layout(cfg: ModelConfig, tp_size: int) -> TPLayout:
    """The layout of `cfg` over `tp_size` ranks; ValueError with the reason for a model that cannot be split."""
    if not 1 <= tp_size <= MAX_TP_SIZE:
        raise ValueError(f"tensor_parallel_size must be in 1..{MAX_TP_SIZE}, got {tp_size}")
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    if kvh <= 0 or h % kvh:
        raise ValueError(f"num_attention_heads {h} is not a multiple of num_key_value_heads {kvh}")
    if h % tp_size:
        raise ValueError(f"num_attention_heads {h} is not divisible by tensor_parallel_size {tp_size}")
    hq, group = h // tp_size, h // kvh
    kv_per_rank, kv_lists = 0, []
    for count in (c for c in range(1, hq + 1) if hq % c == 0):  # fewest local KV heads that work on every rank
        lists = [_kv_heads_of(r * hq, hq, group, count) for r in range(tp_size)]
        if all(x is not None for x in lists):
            kv_per_rank, kv_lists = count, [x for x in lists if x is not None]
            break
    assert kv_per_rank, "count == hq (local group 1) always works"
    block = cfg.quantization.block_size if cfg.quantization is not None else None
    granule = max(block) if block is not None else 1
    if cfg.intermediate_size < tp_size * granule:
        raise ValueError(
            f"intermediate_size {cfg.intermediate_size} is too small to split over {tp_size} ranks"
            + (f" in whole {granule}-column FP8 blocks" if granule > 1 else "")
        )
    ffn = _split(cfg.intermediate_size, tp_size, granule)
    shard = -(-cfg.vocab_size // tp_size)
    ranks = tuple(
        RankLayout(
            rank=r,
            q_heads=(r * hq, (r + 1) * hq),
            kv_heads=kv_lists[r],
            vocab=(min(r * shard, cfg.vocab_size), min((r + 1) * shard, cfg.vocab_size)),
            ffn=ffn[r],
        )
        for r in range(tp_size)
    )
    return TPLayout(tp_size, cfg.vocab_size, shard, kv_per_rank, ranks)


def local_config(cfg: ModelConfig, rank: RankLayout) -> ModelConfig:
    """`cfg` with the sizes one rank's modules are built with (its heads, KV heads, FFN columns, vocab rows)."""
    return dataclasses.replace(
        cfg,
        num_heads=rank.num_q_heads,
        num_kv_heads=rank.num_kv_heads,
        intermediate_size=rank.ffn_size,
        vocab_size=rank.vocab_size,
    )
