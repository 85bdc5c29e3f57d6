"""WorkRate: units per busy second over recent work, steps reported in parts."""

import pytest

from pdserve.telemetry.rates import WorkRate


def test_rate_of_busy_time_not_wall_time():
    r = WorkRate(tau_s=10.0)
    assert r.rate() is None  # nothing measured
    r.add(1000, 0.1)
    r.add(3000, 0.3)
    assert r.rate() == pytest.approx(10_000, rel=1e-2)


def test_recent_work_dominates():
    r = WorkRate(tau_s=1.0)
    r.add(1000, 1.0)  # 1k/s long ago
    for _ in range(150):
        r.add(100, 0.01)  # then 10k/s for 1.5 s of work
    assert r.rate() > 5000


def test_step_parts_add_up_to_one_sample():
    r = WorkRate(tau_s=100.0)
    r.add_to_step("s1", 512, 10.0, 10.05)  # two requests of one step: 1024 tokens in 0.1 s
    r.add_to_step("s1", 512, 10.0, 10.1)
    r.add_to_step("s2", 2048, 10.2, 10.4)  # next step, still open
    assert r.rate() == pytest.approx((1024 + 2048) / 0.3, rel=1e-2)  # rate() closes the open step
