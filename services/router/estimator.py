"""Online output-length estimator, learned from completed requests and persisted across restarts.

Features (cheap, known before the request runs): a signature of the prompt's first tokens (the task or
template: same system prompt / instruction → same key), the prompt length (log2 bucket), the number of
special tokens (chat-template markers, bucketed). Observations are completion lengths (a request that hit
`max_tokens` counts with that length: censored, so the estimate of open-ended tasks leans low).

The model is a back-off table of running means, most specific first:
    (signature, length bucket) → (signature) → (length bucket, special bucket) → global
A level answers once its key has `MIN_KEY_SAMPLES` observations. The estimate is min(mean, max_tokens).
Each key keeps an exponentially weighted mean (weight 1/n until 1/n < ALPHA, so it tracks drift).

Error: every prediction is checked against the outcome (also while the fallback is in use, so a cold
estimator can prove itself): running mean of |pred − actual| / max(pred, actual, 1), in [0, 1].
`use_learned()` is false while fewer than `min_samples` requests completed or that error exceeds `max_error`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.router.pcs import token_hash

log = logging.getLogger("pdserve.router.estimator")

SIG_TOKENS = 8  # prompt tokens (special tokens skipped) in the signature
MIN_KEY_SAMPLES = 3  # observations before a table key answers
ALPHA = 0.05  # floor of the running mean's update weight
ERR_ALPHA = 0.02  # update weight of the running error
MAX_KEYS = 4096  # per level (least recently used dropped)
VERSION = 1


@dataclass(frozen=True)
class Features:
    signature: str
    len_bucket: int
    special_bucket: int

    def keys(self) -> list[str]:
        """One key per back-off level, most specific first."""
        return [
            f"s{self.signature}|l{self.len_bucket}",
            f"s{self.signature}",
            f"l{self.len_bucket}|p{self.special_bucket}",
            "*",
        ]


def features(token_ids: list[int], special_ids: frozenset[int], n_special: int) -> Features:
    plain = [t for t in token_ids[: 4 * SIG_TOKENS] if t not in special_ids][:SIG_TOKENS]
    return Features(token_hash(plain).hex(), max(0, len(token_ids).bit_length() - 1), min(n_special, 8).bit_length())


class OutputLengthEstimator:
    """Thread-safe; `predict` and `observe` are O(levels)."""

    def __init__(self, min_samples: int = 50, max_error: float = 0.5, model: str = ""):
        self.min_samples = min_samples
        self.max_error = max_error
        self.model = model  # identity of the tokenizer the signatures were computed with
        self._lock = threading.Lock()
        self._levels: list[OrderedDict[str, list[float]]] = [OrderedDict() for _ in range(4)]  # key -> [n, mean]
        self.samples = 0
        self.error = 1.0  # pessimistic until measured
        self._err_n = 0
        self.dirty = False

    def predict(self, f: Features, max_tokens: int) -> int | None:
        """Learned estimate (None when no level has enough data)."""
        with self._lock:
            for level, key in zip(self._levels, f.keys()):
                entry = level.get(key)
                if entry is not None and entry[0] >= MIN_KEY_SAMPLES:
                    return max(1, min(max_tokens, round(entry[1])))
        return None

    def use_learned(self) -> bool:
        return self.samples >= self.min_samples and self.error <= self.max_error

    def mode(self, fallback_mode: str) -> str:
        return "learned" if self.use_learned() else fallback_mode

    def observe(self, f: Features, actual: int, predicted: int | None) -> None:
        """Learn from a completed request; `predicted` is what `predict` said at admission (None: no estimate)."""
        with self._lock:
            if predicted is not None:
                err = abs(predicted - actual) / max(predicted, actual, 1)
                self._err_n += 1
                a = max(1.0 / self._err_n, ERR_ALPHA)
                self.error += a * (err - self.error)
            for level, key in zip(self._levels, f.keys()):
                entry = level.get(key)
                if entry is None:
                    entry = level[key] = [0.0, 0.0]
                    if len(level) > MAX_KEYS:
                        level.popitem(last=False)
                else:
                    level.move_to_end(key)
                entry[0] += 1
                entry[1] += max(1.0 / entry[0], ALPHA) * (actual - entry[1])
            self.samples += 1
            self.dirty = True

    # ---- persistence (JSON; never pickle) ----------------------------------------------------------------
    def to_json(self) -> str:
        with self._lock:
            self.dirty = False
            return json.dumps(
                {
                    "version": VERSION,
                    "model": self.model,
                    "samples": self.samples,
                    "error": self.error,
                    "err_n": self._err_n,
                    "levels": [list(lv.items()) for lv in self._levels],
                }
            )

    def load_json(self, text: str) -> bool:
        """Restore a saved state; False (and stay cold) when it belongs to another model or is malformed."""
        try:
            d = json.loads(text)
            if d.get("version") != VERSION or d.get("model") != self.model:
                log.info("estimator state is for another model/version: starting cold")
                return False
            levels = [OrderedDict((str(k), [float(v[0]), float(v[1])]) for k, v in lv) for lv in d["levels"]]
            if len(levels) != 4:
                raise ValueError("expected 4 levels")
            samples, error, err_n = int(d["samples"]), float(d["error"]), int(d["err_n"])
        except (ValueError, TypeError, KeyError, IndexError) as e:
            log.warning("ignoring malformed estimator state: %s", e)
            return False
        with self._lock:
            self._levels, self.samples, self.error, self._err_n = levels, samples, error, err_n
        return True
