"""SLO controller driven by synthetic samples (pure: explicit clock, no gRPC): window and percentile, AIMD
tighten/relax with hysteresis and bounds, per-instance tracking, and the scheduler applying the factors to
admission (prefill TTFT budget, decode KV pool share)."""

from __future__ import annotations

import pytest

from pdserve.router.admission import Rejected
from pdserve.router.config import RouterConfig
from pdserve.router.instances import COLOCATED, DECODE, PREFILL
from pdserve.router.scheduler import Job, Scheduler
from pdserve.router.slo import TPOT, TTFT, AimdController, SlidingWindow, SloSettings, SloTracker, percentile

S = SloSettings(ttft_s=0.35, tpot_s=0.015, window_s=30.0, min_samples=5, interval_s=1.0)


def test_percentile_matches_linear_interpolation():
    v = [float(i) for i in range(1, 11)]
    assert percentile(v, 90) == pytest.approx(9.1)
    assert percentile(v, 50) == pytest.approx(5.5)
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 90)


def test_window_forgets_samples_older_than_the_window():
    w = SlidingWindow(10.0)
    for t in range(20):
        w.add(float(t), now=float(t))
    assert w.values(now=19.0) == [float(t) for t in range(9, 20)]
    assert w.values(now=19.0, since=15.0) == [15.0, 16.0, 17.0, 18.0, 19.0]
    assert w.values(now=100.0) == []


def feed(w: SlidingWindow, value: float, n: int, t0: float, dt: float = 0.1) -> float:
    for i in range(n):
        w.add(value, t0 + i * dt)
    return t0 + n * dt


def test_violation_tightens_multiplicatively_and_is_bounded():
    w, c = SlidingWindow(S.window_s), AimdController(S, S.ttft_s)
    t = 0.0
    factors = []
    for _ in range(30):
        t = feed(w, 1.0, S.min_samples, t)  # every sample far above 350 ms
        factors.append(c.update(w, t))
        t += S.interval_s
    assert factors[0] == pytest.approx(S.decrease)
    assert factors[1] == pytest.approx(S.decrease**2)
    assert all(b <= a for a, b in zip(factors, factors[1:]))
    assert factors[-1] == S.min_factor
    assert c.observed == pytest.approx(1.0)


def test_each_change_is_judged_by_fresh_samples_only():
    """After a decrease, the overload samples that caused it no longer count: no further decrease until
    min_samples new samples say so (no runaway to the floor on one burst)."""
    w, c = SlidingWindow(S.window_s), AimdController(S, S.ttft_s)
    t = feed(w, 1.0, 20, 0.0)
    assert c.update(w, t) == pytest.approx(S.decrease)
    for _ in range(5):  # time passes, the old bad samples are still in the window, nothing new
        t += S.interval_s
        assert c.update(w, t) == pytest.approx(S.decrease)
    t = feed(w, 0.1, S.min_samples, t)  # fresh samples well below target × relax_below
    t += S.interval_s
    assert c.update(w, t) == pytest.approx(S.decrease + S.increase)


def test_hysteresis_band_holds_and_comfortable_margin_relaxes_to_one():
    w, c = SlidingWindow(S.window_s), AimdController(S, S.ttft_s, factor=0.5)
    t = 0.0
    t = feed(w, S.ttft_s * 0.9, S.min_samples, t)  # below target but inside the band (relax_below = 0.8)
    assert c.update(w, t) == 0.5
    t += S.window_s  # the band's samples age out of the window
    steps = 0
    while c.factor < 1.0:
        t = feed(w, S.ttft_s * 0.5, S.min_samples, t + S.interval_s)
        c.update(w, t)
        steps += 1
    assert steps == pytest.approx(0.5 / S.increase, abs=1)
    assert c.factor == 1.0  # never above the configured budget
    t = feed(w, S.ttft_s * 0.5, S.min_samples, t + S.interval_s)
    assert c.update(w, t) == 1.0


def test_rate_limited_to_one_update_per_interval():
    w, c = SlidingWindow(S.window_s), AimdController(S, S.ttft_s)
    t = feed(w, 1.0, 50, 0.0)
    assert c.update(w, t) == pytest.approx(S.decrease)
    t2 = feed(w, 1.0, 50, t, dt=0.001)  # plenty of fresh violations, but within the same interval
    assert c.update(w, t2) == pytest.approx(S.decrease)
    assert c.update(w, t + S.interval_s) == pytest.approx(S.decrease**2)


def test_idle_window_relaxes_and_too_few_samples_hold():
    w, c = SlidingWindow(S.window_s), AimdController(S, S.ttft_s, factor=0.3)
    t = feed(w, 1.0, S.min_samples - 1, 0.0)  # too few to act on
    assert c.update(w, t) == 0.3
    t += S.window_s + 1  # nothing for a whole window: probe upward
    assert c.update(w, t) == pytest.approx(0.35)
    assert c.update(w, t + S.interval_s) == pytest.approx(0.4)
    assert c.observed is None


def test_control_off_observes_without_changing_the_factor():
    off = SloSettings(**{**S.__dict__, "control": False})
    w, c = SlidingWindow(off.window_s), AimdController(off, off.ttft_s)
    t = feed(w, 1.0, 50, 0.0)
    assert c.update(w, t) == 1.0 and c.observed == pytest.approx(1.0)


def test_tracker_keeps_instances_and_metrics_apart_and_forgets_removed_ones():
    tr = SloTracker(S)
    t = 0.0
    for i in range(10):
        tr.observe("a:1", TTFT, 1.0, t + i * 0.1)  # a: TTFT violated
        tr.observe("b:1", TPOT, 0.005, t + i * 0.1)  # b: TPOT fine
        tr.observe("b:1", TTFT, 0.05, t + i * 0.1)
    f = tr.update(["a:1", "b:1"], 2.0)
    assert f["a:1"] == (pytest.approx(S.decrease), 1.0)
    assert f["b:1"] == (1.0, 1.0)
    snap = tr.snapshot()
    assert snap["a:1"][TTFT][0] == pytest.approx(1.0) and snap["a:1"][TPOT] == (None, 1.0)
    assert tr.update(["b:1"], 3.0).keys() == {"b:1"} and "a:1" not in tr.snapshot()
    tr.finished(0.1, 0.01)
    tr.finished(0.1, None)
    tr.finished(0.5, 0.01)
    tr.finished(0.1, 0.02)
    assert (tr.met, tr.missed) == (2, 2)


# ---- the scheduler applies the factors ------------------------------------------------------------------------
def sched(**kw) -> Scheduler:
    cfg = dict(model="m", slo_min_samples=3, slo_interval_s=0.0, ttft_budget_ms=350, prefill_floor_tokens=1000)
    cfg.update(kw)
    return Scheduler(RouterConfig(**cfg))


def job(name: str, prompt_len: int = 300, pages: int = 10) -> Job:
    return Job(name, 10.0, 10.0, prompt_len, pages, None)


def run_one(s: Scheduler, j: Job, tokens: int = 2) -> None:
    s.submit(j)
    s.wait(j, 1.0)
    s.first_token(j)
    s.finish(j, completed=True, completion_tokens=tokens)
    s.finish(j)


def test_slow_ttft_tightens_the_prefill_budget_of_that_instance():
    s = sched(slo_ttft_ms=1e-6)  # nothing meets a 1 ns TTFT
    p = s.add(PREFILL, "p:1")
    d = s.add(DECODE, "d:1")
    s.update_stats(d, 1000, 1000, 0)
    for i in range(3):
        run_one(s, job(f"r{i}"))
    s.submit(job("trigger"))  # the controller runs at submit
    assert p.ttft_factor == pytest.approx(0.7) and d.ttft_factor == 1.0 and d.tpot_factor == 1.0
    # budget 1000 tokens × 0.7: 300 queued (trigger) + 300 + 300 fits, a fourth does not
    s.submit(job("x1"))
    with pytest.raises(Rejected, match="SLO factor 0.70"):
        s.submit(job("x2", prompt_len=200))
    assert s.slo.missed == 3 and s.slo.met == 0


def test_slow_tpot_shrinks_the_decode_pool_share():
    s = sched(slo_tpot_ms=1e-6)  # 1 ns: any two clock reads are further apart (1 µs was met at times)
    s.add(PREFILL, "p:1")
    d = s.add(DECODE, "d:1")
    s.update_stats(d, 100, 100, 0)
    for i in range(3):
        run_one(s, job(f"r{i}"), tokens=5)
    s.submit(job("a", pages=40))  # controller: TPOT factor 0.7 -> 70 of 100 pages
    assert d.tpot_factor == pytest.approx(0.7)
    s.submit(job("b", pages=25))
    with pytest.raises(Rejected, match="SLO factor 0.70"):
        s.submit(job("c", pages=10))


def test_colocated_instance_gets_both_samples_and_both_factors():
    s = sched(slo_ttft_ms=1e-6, slo_tpot_ms=1e-6)
    c = s.add(COLOCATED, "c:1")
    s.update_stats(c, 1000, 1000, 0, prefill_tokens_per_s=1000.0)
    for i in range(3):
        run_one(s, job(f"r{i}"), tokens=4)
    s.submit(job("t"))
    assert (c.ttft_factor, c.tpot_factor) == (pytest.approx(0.7), pytest.approx(0.7))
