"""Synthetic request streams with known structure, for the output-length estimator's error figures (its tests).

Each request belongs to one of `num_tasks` tasks. A task has a fixed instruction prefix (its tokens start every
prompt of the task, optionally after chat-template markers), a body length range, and an output-length law:
    output = round(mu · LogNormal(0, sigma)),  mu = base + per_token · body_len,  capped by max_tokens
so the best possible predictor (the oracle) knows the task and the body length, and still has the noise.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PREFIX_TOKENS = 12


@dataclass(frozen=True)
class Task:
    prefix: tuple[int, ...]
    base: float  # output tokens independent of the prompt
    per_token: float  # output tokens per body token (summaries grow with the text, answers do not)
    body: tuple[int, int]
    chat: bool  # wrapped in <|im_start|> ... <|im_end|> markers


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    max_tokens: int
    output_len: int  # what the "model" produces (observed)
    oracle: float  # the best prediction possible: the law's mean, capped


def make_tasks(num_tasks: int, rng: random.Random, vocab: int = 512, first_id: int = 5) -> list[Task]:
    tasks = []
    for k in range(num_tasks):
        prefix = tuple(rng.randrange(first_id, vocab) for _ in range(PREFIX_TOKENS))
        base = rng.choice([4, 12, 40, 120, 300])
        per_token = rng.choice([0.0, 0.0, 0.1, 0.5])
        lo = rng.choice([8, 32, 128])
        tasks.append(Task(prefix, float(base), per_token, (lo, lo * 8), chat=k % 2 == 1))
    return tasks


def sample(
    task: Task,
    rng: random.Random,
    vocab: int = 512,
    first_id: int = 5,
    sigma: float = 0.3,
    markers: tuple[int, int] = (3, 4),
) -> Sample:
    body_len = rng.randint(*task.body)
    body = [rng.randrange(first_id, vocab) for _ in range(body_len)]
    ids = [*task.prefix, *body]
    if task.chat:
        ids = [markers[0], *ids, markers[1], markers[0]]
    max_tokens = rng.choice([64, 256, 1024])
    mu = task.base + task.per_token * body_len
    out = max(1, min(max_tokens, round(mu * math.exp(rng.gauss(0.0, sigma)))))
    return Sample(ids, max_tokens, out, min(max_tokens, mu * math.exp(sigma**2 / 2)))


def workload(n: int, seed: int = 0, num_tasks: int = 8, vocab: int = 512) -> list[Sample]:
    rng = random.Random(seed)
    tasks = make_tasks(num_tasks, rng, vocab)
    return [sample(rng.choice(tasks), rng, vocab) for _ in range(n)]


def rel_error(predicted: float, actual: float) -> float:
    """The estimator's error measure: |p − a| / max(p, a, 1), in [0, 1]."""
    return abs(predicted - actual) / max(predicted, actual, 1.0)
