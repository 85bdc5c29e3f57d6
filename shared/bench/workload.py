"""What `pdserve bench` sends: length distributions, arrival schedules, trace files and fresh prompts.

A request is a `RequestSpec`: an index, an arrival time (open loop) and exact prompt / output lengths. Outputs are
forced to their length (`ignore_eos` + `max_tokens`), prompts are random token ids from the model's vocabulary
(special and added tokens left out) that start with the request's index, so no two prompts of a run share a page
and a run's random nonce keeps runs apart: the prompt cache cannot flatter the figures.
"""

from __future__ import annotations

import itertools
import json
import math
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAX_DRAWS = 64  # rejection rounds of a truncated lognormal (each keeps >= 1% of the draws, see LengthDist.parse)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, parsed from `fixed:N` (or just `N`), `uniform:LO,HI` (inclusive) or
    `lognormal:MEAN,SIGMA,MAX` (ShareGPT-like: a lognormal of arithmetic mean MEAN and log-space sigma SIGMA,
    truncated to [1, MAX] by redrawing, so there is no spike at MAX)."""

    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float  # fixed: N; uniform: LO; lognormal: MEAN
    b: float = 0.0  # uniform: HI; lognormal: SIGMA
    cap: int = 0  # lognormal: MAX

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, _, rest = text.strip().partition(":")
        if not rest and kind.isdigit():
            kind, rest = "fixed", kind
        try:
            nums = [float(x) for x in rest.split(",")] if rest else []
        except ValueError:
            raise ValueError(f"length distribution {text!r}: the parameters must be numbers") from None
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1 and nums[0].is_integer():
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1] and all(x.is_integer() for x in nums):
            return cls("uniform", nums[0], nums[1])
        if kind == "lognormal" and len(nums) == 3 and nums[0] >= 1 and nums[1] >= 0 and nums[2] >= 1:
            d = cls("lognormal", nums[0], nums[1], int(nums[2]))
            if d.accept_probability() < 0.01:
                raise ValueError(f"length distribution {text!r}: MAX cuts off more than 99% of the draws")
            return d
        raise ValueError(
            f"length distribution {text!r}: want fixed:N, uniform:LO,HI (1 <= LO <= HI, integers) or "
            "lognormal:MEAN,SIGMA,MAX (MEAN >= 1, SIGMA >= 0, MAX >= 1)"
        )

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)},{int(self.b)}"
        return f"lognormal:{self.a:g},{self.b:g},{self.cap}"

    @property
    def max(self) -> int:
        """The largest length it can draw."""
        return int(self.a) if self.kind == "fixed" else int(self.b) if self.kind == "uniform" else self.cap

    def _mu(self) -> float:
        return math.log(self.a) - self.b**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = MEAN

    def accept_probability(self) -> float:
        """lognormal: P(1 <= round(X) <= MAX), the share of draws the truncation keeps."""
        if self.b == 0:
            return 1.0 if 1 <= round(self.a) <= self.cap else 0.0

        def cdf(x: float) -> float:
            return 0.5 * (1 + math.erf((math.log(x) - self._mu()) / (self.b * math.sqrt(2))))

        return cdf(self.cap + 0.5) - cdf(0.5)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths (int64 [n])."""
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n, dtype=np.int64)
        out = np.empty(n, dtype=np.int64)
        todo: np.ndarray = np.arange(n)  # indexes still to draw
        for _ in range(_MAX_DRAWS):
            if not len(todo):
                return out
            x = np.rint(rng.lognormal(self._mu(), self.b, size=len(todo)))
            ok = (x >= 1) & (x <= self.cap)
            out[todo[ok]] = x[ok]
            todo = todo[~ok]
        out[todo] = np.clip(np.rint(rng.lognormal(self._mu(), self.b, size=len(todo))), 1, self.cap)
        return out  # reached with probability < 0.99 ** 64 per length: clipped rather than looping on


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: `arrival_s` after the run's start (None: closed loop, sent when a slot frees)."""

    index: int
    input_tokens: int
    output_tokens: int
    arrival_s: float | None = None


def poisson_arrivals(rate: float, rng: np.random.Generator, n: int | None = None, duration_s: float | None = None):
    """Arrival times (seconds, float64 [k]) of a Poisson process at `rate` requests/s, the first at 0: `n` of them,
    or those before `duration_s`. rate = inf sends everything at 0 (n must be given)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if math.isinf(rate):
        if n is None:
            raise ValueError("an infinite rate needs a request count")
        return np.zeros(n)
    if n is not None:
        gaps = rng.exponential(1.0 / rate, size=n)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    if duration_s is None:
        raise ValueError("give a request count or a duration")
    times: list[float] = []
    t = 0.0
    while t < duration_s:
        times.append(t)
        t += float(rng.exponential(1.0 / rate))
    return np.asarray(times)


def sample_lengths(input_dist: LengthDist, output_dist: LengthDist, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n (input, output) lengths, reproducible from `seed`."""
    rng = np.random.default_rng([seed, 1])
    return input_dist.sample(rng, n), output_dist.sample(rng, n)


def open_loop_specs(
    rate: float, input_dist: LengthDist, output_dist: LengthDist, seed: int, n: int | None, duration_s: float | None
) -> list[RequestSpec]:
    """Poisson arrivals at `rate` (n requests, or those arriving within duration_s), lengths from the two laws."""
    arrivals = poisson_arrivals(rate, np.random.default_rng([seed, 0]), n, duration_s)
    ins, outs = sample_lengths(input_dist, output_dist, len(arrivals), seed)
    return [RequestSpec(i, int(ins[i]), int(outs[i]), float(arrivals[i])) for i in range(len(arrivals))]


@dataclass(frozen=True)
class SpecStream:
    """Requests without arrival times (fixed concurrency): `limit` of them, or endless (a run by duration); lengths
    drawn in blocks of 1024, reproducible from `seed`. Picklable, so worker processes draw the same stream."""

    input_dist: LengthDist
    output_dist: LengthDist
    seed: int
    limit: int | None = None

    def __iter__(self) -> Iterator[RequestSpec]:
        for block in itertools.count() if self.limit is None else range(-(-self.limit // 1024)):
            ins, outs = sample_lengths(self.input_dist, self.output_dist, 1024, self.seed + 7919 * (block + 1))
            for k in range(1024):
                i = block * 1024 + k
                if self.limit is not None and i >= self.limit:
                    return
                yield RequestSpec(i, int(ins[k]), int(outs[k]))


# ---- trace files ---------------------------------------------------------------------------------------------
_TRACE_KEYS = (
    ("arrival_s", "input_tokens", "output_tokens", 1.0),
    ("timestamp", "input_length", "output_length", 1e-3),
)


def load_trace(path: str | Path) -> list[RequestSpec]:
    """A JSONL trace, one request per line: {"arrival_s": s, "input_tokens": n, "output_tokens": m}, or the
    Mooncake trace's {"timestamp": ms, "input_length": n, "output_length": m}. Arrivals are made relative to the
    first and sorted; blank lines are skipped. A bad line raises ValueError naming it."""
    rows: list[tuple[float, int, int]] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            keys = next(k for k in _TRACE_KEYS if k[0] in obj)
            t, n_in, n_out = float(obj[keys[0]]) * keys[3], obj[keys[1]], obj[keys[2]]
            if not (isinstance(n_in, int) and isinstance(n_out, int) and n_in >= 1 and n_out >= 1 and t >= 0):
                raise ValueError
        except (ValueError, KeyError, StopIteration, TypeError):
            raise ValueError(
                f"{path}:{lineno}: want {{'arrival_s': s >= 0, 'input_tokens': n >= 1, 'output_tokens': m >= 1}} "
                f"(or Mooncake's timestamp / input_length / output_length), got {line.strip()[:200]!r}"
            ) from None
        rows.append((t, n_in, n_out))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [RequestSpec(i, n_in, n_out, t - t0) for i, (t, n_in, n_out) in enumerate(rows)]


# ---- prompts -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Vocabulary:
    """The token ids prompts are drawn from, and what is known of the model (from its directory)."""

    ids: np.ndarray  # int64 [k]: ordinary tokens (no special or added ones)
    source: str
    max_model_len: int | None = None

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Vocabulary:
        """The vocabulary of a Hugging Face model or tokenizer directory (tokenizer.json; config.json when present
        bounds the ids by the model's vocab_size and gives its context length)."""
        from tokenizers import Tokenizer

        d = Path(path)
        if not (d / "tokenizer.json").exists():
            raise ValueError(f"{d}: no tokenizer.json (pass the served model's directory)")
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        size = tok.get_vocab_size(with_added_tokens=True)
        max_len = None
        if (d / "config.json").exists():
            cfg = json.loads((d / "config.json").read_text())
            size = min(size, int(cfg.get("vocab_size", size)))
            max_len = int(cfg["max_position_embeddings"]) if "max_position_embeddings" in cfg else None
        added = set(tok.get_added_tokens_decoder())
        ids = np.asarray([i for i in range(size) if i not in added], dtype=np.int64)
        if len(ids) < 2:
            raise ValueError(f"{d}: the vocabulary has fewer than 2 ordinary tokens")
        return cls(ids, f"tokenizer:{d}", max_len)

    @classmethod
    def from_size(cls, vocab_size: int, first_id: int = 0) -> Vocabulary:
        """Ids [first_id, vocab_size): without the tokenizer, special tokens cannot be left out."""
        if vocab_size - first_id < 2:
            raise ValueError("the vocabulary must have at least 2 ids")
        return cls(np.arange(first_id, vocab_size, dtype=np.int64), f"size:{vocab_size}")


@dataclass(frozen=True)
class PromptMaker:
    """Fresh prompts: request i's prompt starts with i written in base len(vocab) (2 tokens), then random ids from
    a generator seeded by (nonce, run, i). Within a run, prompts never share a first page (for i < len(vocab)^2);
    another run (each rate of a sweep, the warm-up) or another nonce draws other tails."""

    vocab: Vocabulary
    nonce: int
    run: int = 0

    @classmethod
    def fresh(cls, vocab: Vocabulary, seed: int | None = None) -> PromptMaker:
        """seed None: a random nonce (the default: a rerun against the same stack must not hit its cache)."""
        return cls(vocab, secrets.randbits(48) if seed is None else seed)

    def for_run(self, run: int) -> PromptMaker:
        return PromptMaker(self.vocab, self.nonce, run)

    def make(self, index: int, length: int) -> list[int]:
        ids = self.vocab.ids
        k = len(ids)
        rng = np.random.default_rng([self.nonce, self.run, index])
        out = ids[rng.integers(0, k, size=length)]
        head = [index % k, (index // k) % k][: min(2, length)]
        out[: len(head)] = ids[head]
        return out.tolist()
