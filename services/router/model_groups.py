"""What the scheduler keeps per served model (a model group): its own priority queue, KV page size and drain rate.

A request only ever waits for, and runs on, instances of its model: one queue per model, so that the head request
of a model whose instances are full never holds back the requests of another model (the queue order is strict
within a model). The KV page size is per model too: pages are only exchanged between instances of one model.
"""

from __future__ import annotations

from pdserve.router.admission import DrainRate
from pdserve.router.priority import PriorityQueue


class ModelQueues:
    """One PriorityQueue per model name, made on first use; `len()` counts every queued request."""

    def __init__(self, aging_pcs_per_s: float):
        self._aging = aging_pcs_per_s
        self._queues: dict[str, PriorityQueue] = {}

    def of(self, model: str) -> PriorityQueue:
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = PriorityQueue(self._aging)
        return q

    def models(self) -> list[str]:
        """Models with queued requests."""
        return [m for m, q in self._queues.items() if len(q)]

    def depth(self, model: str) -> int:
        q = self._queues.get(model)
        return 0 if q is None else len(q)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())


class ModelDrainRates:
    """KV pages of finished decode requests per second, per model (the retry-after hints of its admission)."""

    def __init__(self) -> None:
        self._rates: dict[str, DrainRate] = {}

    def of(self, model: str) -> DrainRate:
        r = self._rates.get(model)
        if r is None:
            r = self._rates[model] = DrainRate()
        return r


def for_model(model: str) -> str:
    """` of model 'NAME'` for messages (nothing for the unnamed model of a router without model names)."""
    return f" of model {model!r}" if model else ""
