"""Instance pools: outstanding PCS per instance, least-loaded choice."""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class Instance:
    address: str
    outstanding_pcs: float = 0.0
    active: int = 0


class InstancePool:
    """Picks the instance with the least outstanding PCS (ties: fewest active, then list order)."""

    def __init__(self, role: str, addresses: list[str]):
        self.role = role
        self._lock = threading.Lock()
        self._instances = [Instance(a) for a in addresses]

    def acquire(self, pcs: float, exclude: frozenset[str] = frozenset()) -> Instance:
        with self._lock:
            candidates = [i for i in self._instances if i.address not in exclude] or self._instances
            best = min(candidates, key=lambda i: (i.outstanding_pcs, i.active))
            best.outstanding_pcs += pcs
            best.active += 1
            return best

    def release(self, inst: Instance, pcs: float) -> None:
        with self._lock:
            inst.outstanding_pcs = max(0.0, inst.outstanding_pcs - pcs)
            inst.active -= 1

    def snapshot(self) -> list[Instance]:
        with self._lock:
            return [Instance(i.address, i.outstanding_pcs, i.active) for i in self._instances]
