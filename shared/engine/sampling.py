"""Sampling parameters and the per-request sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.errors import InvalidRequest


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    seed: int | None = None  # per-request generator seed (deterministic regardless of batch mates)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, max_model_len: int | None = None) -> None:
        """Raise ValueError(reason) for values the engine cannot honour."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if max_model_len is not None and self.max_tokens > max_model_len:
            raise InvalidRequest(f"max_tokens {self.max_tokens} exceeds the model context of {max_model_len} tokens")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):  # also rejects NaN
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise InvalidRequest(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64)
    return g


def skip_draws(generator: torch.Generator, vocab_size: int, n: int) -> None:
    """Advance a request's generator past `n` sampled tokens (each `sample` draws one [V] exponential vector), so
    that a request continued elsewhere (prefill -> decode, or a failover resume) samples as if uninterrupted."""
    for _ in range(n):
        torch.empty(vocab_size, device=generator.device).exponential_(1.0, generator=generator)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a float32 logits row [V]. Greedy when temperature == 0, else temperature -> top-k ->
    top-p -> exponential-race sampling with the request's own generator (so results depend only on the
    request's seed and its own logits, never on the batch)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)  # argmax(p / E) ~ Categorical(p)
    return int(torch.argmax(probs / noise))
