"""Admission control: capacity per instance in PCS units, reject early instead of queueing without bound.

An instance's load is the PCS of requests queued for it (reserved at admission) plus those running on it.
A request is admitted when at least one eligible instance of each role stays within its budget:

    load + PCS <= capacity × batch_utilization_threshold      (an idle instance always admits, so a request
                                                               larger than the budget still runs somewhere)

Otherwise it is rejected with RESOURCE_EXHAUSTED and a retry-after hint: the time for the least-loaded
instance to drain the excess at the rate the role has been completing PCS recently.
"""

from __future__ import annotations

import math
import time

from pdserve.router.instances import Instance

RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S, RETRY_AFTER_UNKNOWN_S = 0.05, 30.0, 1.0


class Rejected(Exception):
    """The router is at capacity (RESOURCE_EXHAUSTED); retry after `retry_after_s`."""

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class DrainRate:
    """PCS completed per second, exponentially decayed over `tau_s` (0 until something completes)."""

    def __init__(self, tau_s: float = 10.0):
        self.tau_s = tau_s
        self._sum = 0.0
        self._t = time.monotonic()
        self._start = self._t

    def add(self, pcs: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._sum = self._sum * math.exp(-(now - self._t) / self.tau_s) + pcs
        self._t = now

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        window = min(self.tau_s, max(now - self._start, 1e-3))
        return self._sum * math.exp(-(now - self._t) / self.tau_s) / window


def fits(inst: Instance, pcs: float, threshold: float) -> bool:
    return inst.load_pcs == 0 or inst.load_pcs + pcs <= inst.capacity_pcs * threshold


def admit(role: str, candidates: list[Instance], pcs: float, threshold: float, drain: DrainRate) -> Instance:
    """The instance to reserve `pcs` on (least relative load among those within budget), or raise Rejected."""
    ok = [i for i in candidates if fits(i, pcs, threshold)]
    if ok:
        return min(ok, key=lambda i: (i.load_pcs / i.capacity_pcs, i.in_flight))
    excess = min(i.load_pcs + pcs - i.capacity_pcs * threshold for i in candidates)
    rate = drain.rate()
    retry = excess * len(candidates) / rate if rate > 0 else RETRY_AFTER_UNKNOWN_S
    retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, retry))
    load = ", ".join(f"{i.address} {i.load_pcs:.0f}/{i.capacity_pcs:.0f}" for i in candidates)
    raise Rejected(
        f"every {role} instance is above {threshold:.0%} of its PCS capacity (request PCS {pcs:.0f}; "
        f"load/capacity: {load})",
        retry,
    )
