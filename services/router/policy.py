"""Assignment policies: which prefill and which decode instance get the request at the head of the queue.

`pcs` (default):
  - prefill: least outstanding PCS relative to capacity, with prefix affinity: a prompt whose leading KV page
    was last sent to instance X goes to X again (its prompt cache holds that prefix) while X is within its
    admission budget and at most `affinity_slack_pcs` above the least-loaded candidate.
  - decode: least `(1 − free_pages_after/total) + active/decode_active_norm`, from the instance's last Stats
    corrected by what the router dispatched since; `decode_choice = p2c` compares two random candidates
    instead of all (for several routers sharing instances, where the full scan would herd).
  - colocated (an instance that prefills and decodes): the decode cost plus its prompt tokens awaiting their
    first token relative to `prefill_max_inflight_tokens` (a long prompt prefilling there delays the next one).
Baselines for the benchmark: `round_robin` (rotate), `least_requests` (fewest requests in flight).

Candidates passed in are already eligible (up, not excluded by a retry) and have room (the dispatch gate).
See docs/router.md for why these choices.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from pdserve.router.config import RouterConfig
from pdserve.router.instances import Instance

AFFINITY_TABLE_SIZE = 65536


class Job(Protocol):
    pcs: float
    need_pages: int
    page_hash: bytes | None
    model: str


class Policy(Protocol):
    def pick_prefill(self, job: Job, candidates: list[Instance]) -> Instance: ...

    def pick_decode(self, job: Job, candidates: list[Instance]) -> Instance: ...

    def pick_colocated(self, job: Job, candidates: list[Instance]) -> Instance: ...


def decode_cost(inst: Instance, need_pages: int, active_norm: float) -> float:
    free = inst.pages_free_estimate()
    if free is None or inst.stats is None or inst.stats.pages_total == 0:
        used = inst.load_pcs / inst.capacity_pcs  # no Stats yet: fall back to accounted PCS
    else:
        used = 1.0 - (free - need_pages) / inst.stats.pages_total
    return used + inst.active_estimate() / active_norm


class PCSPolicy:
    def __init__(self, cfg: RouterConfig):
        self.affinity = cfg.affinity
        self.slack = cfg.affinity_slack_pcs
        self.threshold = cfg.batch_utilization_threshold
        self.active_norm = cfg.decode_active_norm
        self.p2c = cfg.decode_choice == "p2c"
        self.prefill_norm = float(cfg.prefill_max_inflight_tokens or cfg.prefill_floor_tokens)
        self._rng = random.Random(cfg.seed)
        self._table: OrderedDict[tuple[str, bytes], str] = OrderedDict()  # (model, leading page hash) -> address

    def pick_prefill(self, job: Job, candidates: list[Instance]) -> Instance:
        best = min(candidates, key=lambda i: (i.load_pcs / i.capacity_pcs, i.in_flight, i.assigned))
        if job.page_hash is None or not self.affinity:
            return best
        h = (job.model, job.page_hash)  # two models' prompts may share a leading page: never each other's
        prev = self._table.get(h)
        choice = best
        if prev is not None:
            aff = next((i for i in candidates if i.address == prev), None)
            if (
                aff is not None
                and aff.load_pcs + job.pcs <= aff.capacity_pcs * self.threshold
                and aff.load_pcs - best.load_pcs <= self.slack
            ):
                aff.affinity_hits += 1
                choice = aff
            self._table.move_to_end(h)
        self._table[h] = choice.address
        if len(self._table) > AFFINITY_TABLE_SIZE:
            self._table.popitem(last=False)
        return choice

    def pick_decode(self, job: Job, candidates: list[Instance]) -> Instance:
        if self.p2c and len(candidates) > 2:
            candidates = self._rng.sample(candidates, 2)
        return min(candidates, key=lambda i: (decode_cost(i, job.need_pages, self.active_norm), i.assigned))

    def pick_colocated(self, job: Job, candidates: list[Instance]) -> Instance:
        if self.p2c and len(candidates) > 2:
            candidates = self._rng.sample(candidates, 2)

        def cost(i: Instance) -> float:
            return decode_cost(i, job.need_pages, self.active_norm) + i.inflight_tokens / self.prefill_norm

        return min(candidates, key=lambda i: (cost(i), i.assigned))


class RoundRobinPolicy:
    def __init__(self, cfg: RouterConfig):
        self._next = {"prefill": 0, "decode": 0, "colocated": 0}

    def _pick(self, role: str, candidates: list[Instance]) -> Instance:
        i = self._next[role]
        self._next[role] = i + 1
        return candidates[i % len(candidates)]

    def pick_prefill(self, job: Job, candidates: list[Instance]) -> Instance:
        return self._pick("prefill", candidates)

    def pick_decode(self, job: Job, candidates: list[Instance]) -> Instance:
        return self._pick("decode", candidates)

    def pick_colocated(self, job: Job, candidates: list[Instance]) -> Instance:
        return self._pick("colocated", candidates)


class LeastRequestsPolicy:
    def __init__(self, cfg: RouterConfig):
        pass

    def pick_prefill(self, job: Job, candidates: list[Instance]) -> Instance:
        return min(candidates, key=lambda i: (i.in_flight, i.assigned))

    def pick_decode(self, job: Job, candidates: list[Instance]) -> Instance:
        return min(candidates, key=lambda i: (i.in_flight, i.assigned))

    def pick_colocated(self, job: Job, candidates: list[Instance]) -> Instance:
        return min(candidates, key=lambda i: (i.in_flight, i.assigned))


def make_policy(cfg: RouterConfig) -> Policy:
    policies: dict[str, Callable[[RouterConfig], Policy]] = {
        "pcs": PCSPolicy,
        "round_robin": RoundRobinPolicy,
        "least_requests": LeastRequestsPolicy,
    }
    return policies[cfg.policy](cfg)
