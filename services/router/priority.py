"""Request priority (field or `x-priority` metadata) and the router's priority queue with aging.

Ordering value of a queued request at time t (lowest dispatched first):
    value(t) = PCS / multiplier[priority] − aging · (t − arrival)
Smaller jobs first (a 32-token prompt is not stuck behind queued 4k-token prefills), and priority scales
each request's urgency 1/PCS: high multiplies it by 1.5, normal by 1.0, low by 0.5 (configurable).
Every queued request loses value at the same rate, so the order between two of them never changes while they
wait and the heap key can be fixed at push time: key = PCS/multiplier + aging·arrival. A big or low-priority
request is overtaken only by requests arriving less than (value gap)/aging seconds after it: no starvation.
(Ordering by multiplier·PCS, largest first, was tried too: short prompts wait behind long prefills and P99
TTFT is worse from moderate load on; see docs/router.md.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from enum import Enum
from typing import Any

from pdserve.v1 import generate_pb2


class Priority(str, Enum):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


_FROM_FIELD: dict[int, Priority] = {
    generate_pb2.PRIORITY_LOW: Priority.LOW,
    generate_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    generate_pb2.PRIORITY_HIGH: Priority.HIGH,
}
METADATA_KEY = "x-priority"


def resolve(field_value: int, metadata: Iterable[tuple[str, Any]]) -> Priority:
    """The request field wins when set; else `x-priority: high|normal|low`; else normal.
    Raises ValueError with a reason for a field value outside the enum (proto3 keeps unknown numbers) or an unknown
    metadata value."""
    if field_value in _FROM_FIELD:
        return _FROM_FIELD[field_value]
    if field_value != generate_pb2.PRIORITY_UNSPECIFIED:
        raise ValueError(f"priority {field_value} is not a Priority value (0..{max(_FROM_FIELD)})")
    for key, value in metadata:
        if key == METADATA_KEY:
            v = value.decode() if isinstance(value, bytes) else str(value)
            try:
                return Priority(v.strip().lower())
            except ValueError:
                raise ValueError(f"x-priority must be high, normal or low, not {v!r}") from None
    return Priority.NORMAL


class PriorityQueue:
    """Min-queue on ordering value with lazy removal. Items need a writable `key` attribute and
    a `queued` flag. Ties dispatch in arrival order."""

    def __init__(self, aging_per_s: float):
        self.aging_per_s = aging_per_s
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._live = 0

    def push(self, item, weighted_pcs: float, arrival: float) -> None:
        """Queue `item` with value PCS/multiplier (`weighted_pcs`) at `arrival` (monotonic seconds)."""
        item.key = weighted_pcs + self.aging_per_s * arrival
        self.requeue(item)

    def requeue(self, item) -> None:
        """Put back an item that already has a key (a retry keeps its place)."""
        item.queued = True
        heapq.heappush(self._heap, (item.key, next(self._seq), item))
        self._live += 1

    def peek(self):
        while self._heap and not self._heap[0][2].queued:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def pop(self):
        item = self.peek()
        if item is not None:
            heapq.heappop(self._heap)
            item.queued = False
            self._live -= 1
        return item

    def remove(self, item) -> bool:
        """Drop a queued item (lazily); False when it was not queued."""
        if not item.queued:
            return False
        item.queued = False
        self._live -= 1
        return True

    def __len__(self) -> int:
        return self._live

    def value(self, item, now: float) -> float:
        """The item's ordering value at `now` (for logs and tests)."""
        return item.key - self.aging_per_s * now
