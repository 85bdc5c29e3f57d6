"""The pieces a tensor-parallel `CausalLM` adds to the single-device model (model.py builds its modules at the
rank's local sizes, `layout.local_config`, and loads the rank's slices, `shard.RankSharder`):

- `RankShard`: a rank's group and the layout, handed to `CausalLM` / `load_model`.
- Attention and MLP all-reduce their row-parallel output (o_proj, down_proj partial sums): one all-reduce per block.
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary range (zeros for the others); all-reduce.
- `gather_logits`: each rank's LM head logits (its vocabulary columns), all-gathered to the full vocabulary.

The all-reduce adds the ranks' partial sums in the collective's order, not the single GEMM's, so a TP model's
hidden states and logits equal the TP=1 model's up to float rounding (the last bits), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.tp.comm import TPGroup
from pdserve.engine.tp.layout import RankLayout, TPLayout


@dataclass(frozen=True)
class RankShard:
    """This process's rank of a TP group and the group's layout."""

    group: TPGroup
    layout: TPLayout

    def __post_init__(self) -> None:
        if self.group.world_size != self.layout.tp_size:
            raise ValueError(f"TP group of {self.group.world_size} ranks for a layout of {self.layout.tp_size}")

    @property
    def rank(self) -> RankLayout:
        return self.layout.rank(self.group.rank)


class VocabParallelEmbedding(nn.Module):
    """The rows [start, start + num_rows) of a `vocab_size` x `dim` embedding; ids outside them contribute zeros,
    and the all-reduce over the ranks completes each row (exactly: one rank adds its row to zeros)."""

    def __init__(self, start: int, num_rows: int, dim: int, group: TPGroup):
        super().__init__()
        self.start, self.num_rows, self.group = start, num_rows, group
        self.weight = nn.Parameter(torch.empty(num_rows, dim))  # [num_rows, dim]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (global vocabulary) -> [T, dim]."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)  # [T]
        if self.num_rows == 0:  # an empty last shard (vocab < tp * ceil(vocab / tp) by a whole shard)
            out = self.weight.new_zeros(ids.shape[0], self.weight.shape[1])
        else:
            out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
            out.masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(out)


def gather_logits(local: torch.Tensor, shard: RankShard) -> torch.Tensor:
    """local [N, this rank's vocab columns] float32 -> [N, vocab] (every rank gets all of them)."""
    width = shard.layout.vocab_shard
    if local.shape[1] < width:  # the last rank's shard is shorter: pad to the gather's common width
        local = nn.functional.pad(local, (0, width - local.shape[1]))
    return shard.group.all_gather_columns(local)[:, : shard.layout.vocab_size]
