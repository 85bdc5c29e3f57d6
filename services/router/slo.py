"""SLO-aware admission: per instance, TTFT and TPOT samples over a sliding time window, their percentile, and a
controller that scales the instance's admission budget so that percentile stays within the SLO.

Samples (measured by the router, so they include its queue): TTFT = request arrival → first token streamed, on
the instance that prefilled it; TPOT = (last − first token time) / (tokens − 1) at the end of a request, on the
instance that decoded it (a colocated instance gets both).

Controller (`AimdController`, one per instance and metric), every `interval_s` at most:
  - it looks at the samples of the last `window_s` seconds taken since its last change (so a change is judged by
    what followed it, not by the overload that caused it), and acts once there are `min_samples` of them;
  - observed percentile > SLO: multiplicative decrease, factor × `decrease` (floor `min_factor`);
  - observed percentile < SLO × `relax_below`: additive increase, factor + `increase` (ceiling 1: the configured
    budget); in between it holds (hysteresis band);
  - no sample at all for `window_s` (idle, or every request rejected elsewhere): additive increase too, so an
    instance is never left throttled by a past overload.
What the factors scale (`pdserve.router.admission`): the TTFT factor scales the prefill budget (TTFT budget × rate
and the floor), the TPOT factor the share of the KV pool decode admission fills (fewer, shorter decode batches).

Pure: callers pass the clock (`now`, monotonic seconds); the scheduler calls it under its lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

TTFT, TPOT = "ttft", "tpot"


@dataclass(frozen=True)
class SloSettings:
    ttft_s: float = 0.350
    tpot_s: float = 0.015
    percentile: float = 90.0
    window_s: float = 30.0
    min_samples: int = 10
    interval_s: float = 1.0
    decrease: float = 0.7
    increase: float = 0.05
    relax_below: float = 0.8
    min_factor: float = 0.05
    control: bool = True  # False: observe and export only, the factors stay 1

    def target(self, metric: str) -> float:
        return self.ttft_s if metric == TTFT else self.tpot_s


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


class SlidingWindow:
    """(time, value) samples of the last `window_s` seconds."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def values(self, now: float, since: float = -math.inf) -> list[float]:
        """Values of the window (at `now`) taken at or after `since`."""
        self._prune(now)
        return [v for t, v in self._samples if t >= since]

    def last_time(self) -> float | None:
        return self._samples[-1][0] if self._samples else None


@dataclass
class AimdController:
    """One budget factor in [min_factor, 1] for one instance and metric (module docstring)."""

    settings: SloSettings
    target_s: float
    factor: float = 1.0
    last_change: float = -math.inf  # when the factor last changed (samples before it no longer count)
    last_update: float = -math.inf
    observed: float | None = None  # the percentile the last update saw (over its samples), None without any

    def update(self, window: SlidingWindow, now: float) -> float:
        s = self.settings
        if now - self.last_update < s.interval_s:
            return self.factor
        self.last_update = now
        fresh = window.values(now, since=self.last_change)
        recent = window.values(now)
        self.observed = percentile(recent, s.percentile) if recent else None
        if not s.control:
            return self.factor
        if len(fresh) >= s.min_samples:
            p = percentile(fresh, s.percentile)
            if p > self.target_s:
                self._set(max(s.min_factor, self.factor * s.decrease), now)
            elif p < self.target_s * s.relax_below:
                self._set(min(1.0, self.factor + s.increase), now)
        elif not recent and self.factor < 1.0:  # idle for a whole window: probe upward
            self._set(min(1.0, self.factor + s.increase), now)
        return self.factor

    def _set(self, factor: float, now: float) -> None:
        if factor != self.factor:
            self.factor = factor
            self.last_change = now


@dataclass
class InstanceSlo:
    """Windows and controllers of one instance."""

    windows: dict[str, SlidingWindow]
    controllers: dict[str, AimdController]


@dataclass
class SloTracker:
    """Per-instance SLO state, keyed by instance address, plus the router-wide count of requests that met both
    targets (goodput) or missed one."""

    settings: SloSettings
    instances: dict[str, InstanceSlo] = field(default_factory=dict)
    met: int = 0
    missed: int = 0

    def _get(self, address: str) -> InstanceSlo:
        inst = self.instances.get(address)
        if inst is None:
            s = self.settings
            inst = self.instances[address] = InstanceSlo(
                {m: SlidingWindow(s.window_s) for m in (TTFT, TPOT)},
                {m: AimdController(s, s.target(m)) for m in (TTFT, TPOT)},
            )
        return inst

    def observe(self, address: str, metric: str, seconds: float, now: float) -> None:
        self._get(address).windows[metric].add(seconds, now)

    def finished(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """One completed request: did it meet both targets? (TPOT None: one token, only TTFT counts.)"""
        s = self.settings
        ok = ttft_s is not None and ttft_s <= s.ttft_s and (tpot_s is None or tpot_s <= s.tpot_s)
        if ok:
            self.met += 1
        else:
            self.missed += 1

    def update(self, addresses: list[str], now: float) -> dict[str, tuple[float, float]]:
        """Run the controllers of `addresses`; returns address -> (TTFT factor, TPOT factor). Instances not
        listed are forgotten."""
        for gone in set(self.instances) - set(addresses):
            del self.instances[gone]
        out = {}
        for a in addresses:
            inst = self._get(a)
            out[a] = tuple(inst.controllers[m].update(inst.windows[m], now) for m in (TTFT, TPOT))
        return out  # type: ignore[return-value]

    def snapshot(self) -> dict[str, dict[str, tuple[float | None, float]]]:
        """address -> metric -> (observed percentile at the last update or None, factor)."""
        return {
            a: {m: (c.observed, c.factor) for m, c in inst.controllers.items()} for a, inst in self.instances.items()
        }


def register_metrics(metrics, scheduler) -> None:
    """Router gauges (pdserve.telemetry.metrics.ServiceMetrics): `pdserve_slo_target_seconds{metric}`,
    `pdserve_slo_observed_seconds{address,metric}` (the percentile over the window; NaN without samples),
    `pdserve_slo_budget_factor{address,metric}`, and `pdserve_slo_requests_total{result=met|missed}` (goodput: met
    both targets). The instance label is `address` (Prometheus owns `instance`: the scrape target)."""

    def snap():
        with scheduler.lock:
            return scheduler.slo.snapshot()

    s = scheduler.slo.settings
    metrics.gauge(
        "slo_target_seconds",
        f"SLO targets (p{s.percentile:g} over {s.window_s:g}s per instance)",
        lambda: {(TTFT,): s.ttft_s, (TPOT,): s.tpot_s},
        ["metric"],
    )
    metrics.gauge(
        "slo_observed_seconds",
        f"Observed p{s.percentile:g} TTFT / TPOT per instance over the last {s.window_s:g}s",
        lambda: {(a, m): math.nan if v is None else v for a, ms in snap().items() for m, (v, _) in ms.items()},
        ["address", "metric"],
    )
    metrics.gauge(
        "slo_budget_factor",
        "Admission budget factor the SLO controller applies per instance (1 = the configured budget)",
        lambda: {(a, m): f for a, ms in snap().items() for m, (_, f) in ms.items()},
        ["address", "metric"],
    )

    def results():
        with scheduler.lock:
            return {("met",): scheduler.slo.met, ("missed",): scheduler.slo.missed}

    metrics.counter("slo_requests", "Completed requests that met both SLO targets or missed one", results, ["result"])
