"""What the router knows about one prefill, decode or colocated instance: health state, load it accounts, last
Stats, and the SLO controller's budget factors (`pdserve.router.slo`).

Every instance serves one model (`model`, the name requests use): the scheduler groups instances by it, and a
request only ever goes to instances of its model (a prefill never ships KV to a decode of another model).

A colocated instance (prefills and decodes itself) carries both kinds of load: prompt tokens until the first
token (as a prefill instance) and KV pages until the request finishes (as a decode instance).

All fields are guarded by the scheduler's lock (pdserve.router.scheduler.Scheduler.lock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"
ROLES = (PREFILL, DECODE, COLOCATED)


class State(str, Enum):
    UP = "up"  # eligible for new requests
    DRAINING = "draining"  # reports NOT_SERVING or deregistered: finishes what it has, gets nothing new
    DOWN = "down"  # failed health checks / lease expired / UNAVAILABLE: nothing new until it recovers


@dataclass
class DecodeStats:
    """A decode instance's last Stats plus what the router had in flight there when it was taken, so that
    load dispatched since can be added on top: estimate = stats + (router's now − router's then)."""

    pages_free: int
    pages_total: int
    active: int
    router_in_flight: int
    router_pages: int


@dataclass(eq=False)
class Instance:
    role: str
    address: str
    capacity_pcs: float  # admission capacity in PCS units
    registered: bool = False  # announced itself (lease applies) vs static config
    model: str = ""  # the served model name (its group); "" only in a router without model names (tests)
    model_path: str = ""  # its model directory as it announced it ("" = the router's --model)
    state: State = State.UP
    leaving: bool = False  # deregistered: forgotten once its in-flight requests are done
    refused: str = ""  # why an up instance gets no requests (its KV page size differs from the cluster's)
    # load the router accounts to this instance
    running_pcs: float = 0.0  # prefill: dispatched, no first token yet; decode: dispatched, not finished
    reserved_pcs: float = 0.0  # queued requests tentatively bound here (admission)
    in_flight: int = 0  # requests in `running_pcs`
    inflight_tokens: int = 0  # prefill: prompt tokens in flight
    queued_tokens: int = 0  # prefill: prompt tokens of queued requests bound here (admission)
    pages: int = 0  # decode: KV pages the router's in-flight requests need (estimate)
    queued_pages: int = 0  # decode: KV pages of queued requests bound here (admission)
    prefill_tokens_per_s: float = 0.0  # prefill, colocated: measured by the instance (Stats; 0 = not yet)
    stats: DecodeStats | None = None  # decode, colocated
    # SLO controller (pdserve.router.slo): scales the TTFT budget (prefill work) and the KV pool share (decode)
    ttft_factor: float = 1.0
    tpot_factor: float = 1.0
    # counters
    assigned: int = 0
    affinity_hits: int = 0
    failures: int = 0
    # health
    consecutive_failures: int = 0
    last_heartbeat: float = field(default_factory=time.monotonic)
    down_since: float | None = None

    @property
    def load_pcs(self) -> float:
        """Queued (reserved) + running PCS: what admission compares with capacity × threshold."""
        return self.running_pcs + self.reserved_pcs

    @property
    def outstanding_pcs(self) -> float:  # name kept for the metrics gauge (pdserve.telemetry.metrics.watch_pools)
        return self.load_pcs

    def pages_free_estimate(self) -> int | None:
        s = self.stats
        return None if s is None else s.pages_free - max(0, self.pages - s.router_pages)

    def active_estimate(self) -> int:
        s = self.stats
        return self.in_flight if s is None else max(self.in_flight, s.active + self.in_flight - s.router_in_flight)
