"""Prompt complexity score: PCS = w_in·input_len + w_out·estimated_output_len + w_sp·num_special_tokens.

Also the two cheap prompt fingerprints the router keys on: special-token ids of the tokenizer and the hash
of a prompt's leading KV page (prefix affinity, estimator signature). Hashes use hashlib, never `hash()`,
which is salted per process and would differ between router restarts.
"""

from __future__ import annotations

import hashlib
from array import array
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


def special_token_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens plus every added token (chat-template markers such as <|im_start|>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | frozenset(int(i) for i in added.keys())


def count_special(token_ids: list[int], special_ids: frozenset[int]) -> int:
    if special_ids.isdisjoint(token_ids):  # the common case, ~2x faster than counting
        return 0
    return sum(map(special_ids.__contains__, token_ids))


def fallback_output_len(max_tokens: int, input_len: int, mode: str) -> int:
    """Output estimate without the learned model. length_only: from the lengths alone (the budget, capped by a
    typical answer length that grows with the prompt, 16..512); max_tokens: the budget (pessimistic)."""
    if mode == "max_tokens":
        return max_tokens
    return min(max_tokens, max(16, min(512, input_len)))


def score(input_len: int, num_special: int, est_output_len: int, w: PCSWeights) -> PCS:
    return PCS(
        input_len,
        est_output_len,
        num_special,
        w.w_in * input_len + w.w_out * est_output_len + w.w_special * num_special,
    )


def token_hash(token_ids: list[int]) -> bytes:
    """8-byte blake2b of int32 token ids: stable across processes and restarts."""
    return hashlib.blake2b(array("i", token_ids).tobytes(), digest_size=8).digest()


def leading_page_hash(token_ids: list[int], page_size: int) -> bytes | None:
    """Hash of the first full KV page of the prompt; None when the prompt is shorter than a page."""
    if len(token_ids) < page_size:
        return None
    return token_hash(token_ids[:page_size])
