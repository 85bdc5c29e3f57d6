"""Admission control that follows the hardware: reject early (RESOURCE_EXHAUSTED with a retry hint) instead of
queueing more than the instances can serve in time.

- prefill: an instance's load is the prompt tokens queued for it (reserved at admission) plus those it is
  computing (dispatched, no first token yet). Its capacity is about a TTFT budget of work at the prefill rate it
  measures and reports in Stats (`prefill_tokens_per_s`):

      load + prompt_len <= max(floor_tokens, tokens_per_s × ttft_budget_s)

  (`floor_tokens` alone while nothing is measured yet).
- decode: an instance's load is the KV pages of the requests queued for it plus those it runs (prompt +
  estimated output each); it admits while its pool (`kv_pages_total` from Stats) could hold all of them. Before
  its first Stats nothing is known and it admits (the dispatch gate still waits for free pages).

- colocated (prefills and decodes itself): both of the above on the same instance. Its prefill rate is what it
  measures on its mixed steps (prefill chunks computed beside the decode batch, `pdserve.decode.colocated`), so the
  prefill rule reads as a TTFT prediction: a request is admitted, and waits in the router's queue for the
  dispatch gate if need be, while (prompt tokens queued and computing there + its own) / rate fits the TTFT
  budget (`predicted_ttft_s`); only beyond is it rejected.

The SLO controller (`pdserve.router.slo`) scales these per instance: `ttft_factor` multiplies the prefill
capacity (budget × rate and the floor), `tpot_factor` the share of the KV pool decode admission fills.

An idle instance always admits, so a request larger than any budget still runs somewhere. A rejection carries
the time after which a retry should fit: the excess over the budget drained at the measured rate (prefill:
tokens/s; decode: pages of finished requests per second, `DrainRate`), spread by `RetrySlots` so that callers
rejected together come back one after another.
"""

from __future__ import annotations

import math
import time

from pdserve.router.instances import Instance

RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S, RETRY_AFTER_UNKNOWN_S = 0.05, 30.0, 1.0


class Rejected(Exception):
    """The router is at capacity (RESOURCE_EXHAUSTED); retry after `retry_after_s`. `spacing_s`: how long the
    request's own work takes to drain (prefill: its prompt at the instances' rate), the gap `RetrySlots` leaves
    between callers rejected together."""

    def __init__(self, reason: str, retry_after_s: float, spacing_s: float = 0.0):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.spacing_s = spacing_s


class RetrySlots:
    """Pushbacks that send callers rejected together back one after another instead of all at once. Each rejection
    gets the later of its own earliest retry and the slot after the last one promised (plus its `spacing_s`), so a
    burst of N rejected callers returns over about N request-drain times, each finding the room its predecessors'
    work freed, instead of N retrying together, one fitting and N-1 backing off again (the SDK's backoff then grows
    towards its cap, and the last callers of a burst come back up to that cap late). A promise never lies more than
    `max_spread_s` past the caller's earliest retry, so callers rejected in floods (that may never come back) delay
    the others by at most that."""

    def __init__(self, max_spread_s: float = 2.0):
        self.max_spread_s = max_spread_s
        self._horizon = 0.0  # time.monotonic() of the latest slot promised

    def promise(self, now: float, earliest_s: float, spacing_s: float) -> float:
        """Seconds from `now` the caller should wait (clamped to the retry bounds)."""
        earliest = now + earliest_s
        slot = min(max(earliest, self._horizon + spacing_s), earliest + self.max_spread_s)
        self._horizon = max(self._horizon, slot)
        return clamp_retry(slot - now)


class DrainRate:
    """Units completed per second, exponentially decayed over `tau_s` (0 until something completes)."""

    def __init__(self, tau_s: float = 10.0):
        self.tau_s = tau_s
        self._sum = 0.0
        self._t = time.monotonic()
        self._start = self._t

    def add(self, units: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._sum = self._sum * math.exp(-(now - self._t) / self.tau_s) + units
        self._t = now

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        window = min(self.tau_s, max(now - self._start, 1e-3))
        return self._sum * math.exp(-(now - self._t) / self.tau_s) / window


def clamp_retry(seconds: float) -> float:
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, seconds))


# ---- prefill: tokens within a TTFT budget ----------------------------------------------------------------------
def prefill_capacity_tokens(tokens_per_s: float, ttft_budget_s: float, floor_tokens: float) -> float:
    """Prompt tokens an instance may have queued + computing: a TTFT budget of work at its measured rate, never
    below `floor_tokens` (also what an unmeasured instance, rate 0, gets)."""
    return max(float(floor_tokens), tokens_per_s * ttft_budget_s)


def prefill_load_tokens(inst: Instance) -> int:
    """Prompt tokens queued for `inst` plus those it is computing."""
    return inst.queued_tokens + inst.inflight_tokens


def instance_prefill_capacity(inst: Instance, ttft_budget_s: float, floor_tokens: float) -> float:
    """`prefill_capacity_tokens` of `inst`, scaled by its SLO factor."""
    f = inst.ttft_factor
    return prefill_capacity_tokens(inst.prefill_tokens_per_s, ttft_budget_s * f, floor_tokens * f)


def prefill_fits(inst: Instance, load: int, prompt_len: int, ttft_budget_s: float, floor_tokens: float) -> bool:
    return load <= 0 or load + prompt_len <= instance_prefill_capacity(inst, ttft_budget_s, floor_tokens)


def admit_prefill(candidates: list[Instance], prompt_len: int, ttft_budget_s: float, floor_tokens: float) -> Instance:
    """The prefill instance to reserve `prompt_len` tokens on (the one whose queue drains first), or Rejected."""

    def drain_s(i: Instance, extra: int) -> float:  # seconds to compute its load (+ extra) at its rate
        rate = i.prefill_tokens_per_s or floor_tokens / ttft_budget_s
        return (prefill_load_tokens(i) + extra) / rate

    ok = [i for i in candidates if prefill_fits(i, prefill_load_tokens(i), prompt_len, ttft_budget_s, floor_tokens)]
    if ok:
        return min(ok, key=lambda i: (drain_s(i, 0), i.in_flight))
    # once the excess over the budget is computed, the request fits on the instance that drains first
    retry = min(drain_s(i, prompt_len) - ttft_budget_s * i.ttft_factor for i in candidates)
    rate = sum(i.prefill_tokens_per_s or floor_tokens / ttft_budget_s for i in candidates)
    load = ", ".join(
        f"{i.address} {prefill_load_tokens(i)}/{instance_prefill_capacity(i, ttft_budget_s, floor_tokens):.0f} tokens"
        + (f" (SLO factor {i.ttft_factor:.2f})" if i.ttft_factor < 1 else "")
        for i in candidates
    )
    raise Rejected(
        f"every prefill instance has more than {ttft_budget_s * 1e3:.0f} ms of prefill work queued (request "
        f"{prompt_len} prompt tokens; load/capacity: {load})",
        clamp_retry(retry),
        prompt_len / rate,
    )


# ---- decode: what the KV pool can hold ------------------------------------------------------------------------
def decode_load_pages(inst: Instance) -> int:
    """KV pages of the requests queued for `inst` plus those it runs (router estimates)."""
    return inst.queued_pages + inst.pages


def decode_budget_pages(inst: Instance) -> float:
    """KV pages decode admission may fill on `inst`: its pool scaled by its SLO factor (0: pool unknown)."""
    return (inst.stats.pages_total if inst.stats is not None else 0) * inst.tpot_factor


def decode_fits(inst: Instance, load: int, need_pages: int) -> bool:
    budget = decode_budget_pages(inst)
    return load <= 0 or not budget or load + need_pages <= budget


def admit_decode(candidates: list[Instance], need_pages: int, drain_pages: DrainRate) -> Instance:
    """The decode instance to reserve `need_pages` on (most pool left), or Rejected."""

    def room(i: Instance) -> float:
        total = decode_budget_pages(i)
        return (total - decode_load_pages(i)) / total if total else 1.0

    ok = [i for i in candidates if decode_fits(i, decode_load_pages(i), need_pages)]
    if ok:
        return max(ok, key=lambda i: (room(i), -i.in_flight))
    excess = min(decode_load_pages(i) + need_pages - decode_budget_pages(i) for i in candidates if i.stats)
    rate = drain_pages.rate()
    retry = excess * len(candidates) / rate if rate > 0 else RETRY_AFTER_UNKNOWN_S
    load = ", ".join(
        f"{i.address} {decode_load_pages(i)}/{decode_budget_pages(i):.0f} pages"
        + (f" (SLO factor {i.tpot_factor:.2f})" if i.tpot_factor < 1 else "")
        for i in candidates
    )
    raise Rejected(
        f"no decode instance's KV pool can hold this request too ({need_pages} pages; load/pool: {load})",
        clamp_retry(retry),
        need_pages / rate if rate > 0 else 0.0,
    )


# ---- colocated: both on one instance ----------------------------------------------------------------------------
def predicted_ttft_s(inst: Instance, prompt_len: int, ttft_budget_s: float, floor_tokens: float) -> float:
    """Seconds until a request of `prompt_len` prompt tokens admitted on `inst` now would have its first token: the
    prompt tokens queued for and computing on `inst` plus its own, at the prefill rate `inst` measures (a colocated
    instance: beside its decode batch), or `floor_tokens` per TTFT budget before it measured one. `prefill_fits`
    admits exactly while this is within the budget (× the SLO factor), or the load within the floor."""
    rate = inst.prefill_tokens_per_s or floor_tokens / ttft_budget_s
    return (prefill_load_tokens(inst) + prompt_len) / rate


def admit_colocated(
    candidates: list[Instance],
    prompt_len: int,
    need_pages: int,
    ttft_budget_s: float,
    floor_tokens: float,
    drain_pages: DrainRate,
) -> Instance:
    """The colocated instance to reserve the request on: among those where its predicted TTFT fits the budget
    (`predicted_ttft_s`, at the rate measured on mixed steps) and whose KV pool can hold it, the one whose prefill
    queue drains first (then most pool left); else Rejected with the reason of the instances' binding constraint."""
    fits_p = [i for i in candidates if prefill_fits(i, prefill_load_tokens(i), prompt_len, ttft_budget_s, floor_tokens)]
    fits_both = [i for i in fits_p if decode_fits(i, decode_load_pages(i), need_pages)]
    if fits_both:
        return admit_prefill(fits_both, prompt_len, ttft_budget_s, floor_tokens)
    if not fits_p:
        try:
            return admit_prefill(candidates, prompt_len, ttft_budget_s, floor_tokens)  # raises: the prefill reason
        except Rejected as e:
            best = min(predicted_ttft_s(i, prompt_len, ttft_budget_s, floor_tokens) for i in candidates)
            e.reason = f"{e.reason}; predicted TTFT at best {best * 1e3:.0f} ms"
            e.args = (e.reason,)
            raise
    return admit_decode(fits_p, need_pages, drain_pages)  # raises: none of them has KV pool left
