"""Prompt complexity score: PCS = w_in·input_len + w_out·estimated_output_len + w_sp·num_special_tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PCSWeights:
    w_in: float = 0.3
    w_out: float = 0.5
    w_special: float = 1.2


@dataclass(frozen=True)
class PCS:
    input_len: int
    est_output_len: int
    num_special: int
    score: float


def estimate_output_len(max_tokens: int, input_len: int) -> int:
    """Simple estimate until the learned estimator lands: the budget, capped by a typical answer length."""
    return min(max_tokens, max(16, min(512, input_len)))


def score(token_ids: list[int], special_ids: frozenset[int], max_tokens: int, w: PCSWeights) -> PCS:
    n_special = sum(1 for t in token_ids if t in special_ids)
    est = estimate_output_len(max_tokens, len(token_ids))
    return PCS(len(token_ids), est, n_special, w.w_in * len(token_ids) + w.w_out * est + w.w_special * n_special)
