"""Sampling parameters, the per-request sampler (greedy, temperature, top-k, top-p) and log-probabilities.

Log-probabilities are the model's own distribution, log_softmax of the raw logits BEFORE temperature, top-k and
top-p (what OpenAI and vLLM report): they do not change with the sampling knobs, a text scores the same at any
temperature, and greedy requests have them too. They come from the same logits row the token was sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.request_limits import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.errors import InvalidRequest

if TYPE_CHECKING:  # torch loads with the first sampling call: the router and gateway use only the params
    import torch


@dataclass
class TokenLogprob:
    """log P(token) at one generated position and the `top` most likely (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS alternatives per generated token (implies logprobs)
    prompt_logprobs: bool = False  # log P(prompt[i] | prompt[:i]) for i >= 1, computed at prefill
    max_reasoning_tokens: int | None = None  # force the think close tag after this many reasoning tokens
    presence_penalty: float = 0.0  # [-2, 2]: logit -= p for each token generated at least once
    frequency_penalty: float = 0.0  # [-2, 2]: logit -= p * times generated
    repetition_penalty: float = 1.0  # (0, 2]: a prompt / generated token's logit l -> l / p if l > 0 else l * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100] added to its logit
    min_tokens: int = 0  # EOS / stop_token_ids masked and stop strings unmatched before this many tokens
    structured: StructuredSpec | None = None  # constrained decoding (pdserve.engine.structured)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before drawing (penalties, bias, min_tokens,
        structured output); requests without any cost nothing."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.structured is not None

    @property
    def needs_host_logits(self) -> bool:
        """Whether the draw needs the step's logits processed by the host-built plan (penalties, bias, a min_tokens
        EOS ban): a structured output alone only masks, which a decode graph applies itself (`processes_logits`
        minus that)."""
        return self.has_penalties or bool(self.logit_bias) or (self.min_tokens > 0 and self.structured is None)

    def validate(self, max_model_len: int | None = None, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest(reason) for values the engine cannot honour."""
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
        if len(self.stop) > MAX_STOP_STRINGS or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"{len(self.stop)} stop strings and {len(self.stop_token_ids)} stop_token_ids: at most "
                f"{MAX_STOP_STRINGS} and {MAX_STOP_TOKEN_IDS}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequest(f"stop strings may have at most {MAX_STOP_CHARS} characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        budget = self.max_reasoning_tokens
        if budget is not None and not (isinstance(budget, int) and budget >= 0):
            raise InvalidRequest(f"max_reasoning_tokens must be an integer >= 0, got {budget!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also rejects NaN
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries: at most {MAX_LOGIT_BIAS}")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidRequest(f"logit_bias token id {t!r} outside the vocabulary [0, {vocab_size})")
            if not -100.0 <= b <= 100.0:
                raise InvalidRequest(f"logit_bias[{t}] must be in [-100, 100], got {b}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.structured is not None:
            self.structured.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64)
    return g


def skip_draws(generator: torch.Generator, vocab_size: int, n: int) -> None:
    """Advance a request's generator past `n` sampled tokens (each `sample` draws one [V] exponential vector), so
    that a request continued elsewhere (prefill -> decode, or a failover resume) samples as if uninterrupted."""
    import torch

    for _ in range(n):
        torch.empty(vocab_size, device=generator.device).exponential_(1.0, generator=generator)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a float32 logits row [V]. Greedy when temperature == 0, else temperature -> top-k ->
    top-p -> exponential-race sampling with the request's own generator (so results depend only on the
    request's seed and its own logits, never on the batch)."""
    import torch

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


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of the chosen tokens from their logits rows [S, V] (S = len(token_ids)), with `k` alternatives."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    chosen = logp.gather(-1, torch.tensor(token_ids, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if k > 0:
        top = torch.topk(logp, k, dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
        return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in zip(token_ids, chosen, ids, vals)]
    return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
