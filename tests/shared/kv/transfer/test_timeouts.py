"""Decode's page timeout scales with the work ahead (issue 35 item 4): the floor until a rate is measured, then the
expected time of every token still awaited from that prefill instance (a request's batch mates included) times the
slack, up to the ceiling; the watchdog applies a bound that changes while it waits."""

from __future__ import annotations

import threading
import time

from pdserve.kv.transfer.timeouts import PageBudget, PeerLoads, Watchdog

BUDGET = PageBudget(floor_s=0.5, ceiling_s=20.0, slack=3.0)


def test_budget_is_the_floor_without_a_rate_and_clamped_with_one():
    assert BUDGET.seconds(4000, None) == 0.5
    assert BUDGET.seconds(0, 100.0) == 0.5
    assert BUDGET.seconds(10, 100.0) == 0.5  # 0.3 s expected: the floor
    assert BUDGET.seconds(200, 100.0) == 6.0  # 2 s expected, times the slack
    assert BUDGET.seconds(4000, 100.0) == 20.0  # the ceiling


def test_a_short_request_waits_as_long_as_its_batch_mates_work():
    loads = PeerLoads(BUDGET)
    long = loads.open("prefill-a", 4000)
    time.sleep(0.2)
    long.arrived(2000)  # the first chunk: a rate of about 10k tokens/s
    rate = long.load.rate()
    assert rate is not None and 5_000 < rate < 11_000
    short = loads.open("prefill-a", 4)
    expected = 3.0 * 2004 / rate
    assert abs(short.timeout_s() - max(0.5, expected)) < 1e-6  # the long prompt's remaining chunk counts
    other = loads.open("prefill-b", 4)  # another instance: its own load, no rate yet
    assert other.timeout_s() == 0.5
    long.close()  # abandoned: what never arrived leaves the load
    assert short.load.tokens_ahead == 4
    short.arrived(100)  # more than it awaited: counted up to its own tokens
    assert short.load.tokens_ahead == 0
    short.close(), other.close()


def test_watchdog_reads_a_changing_bound():
    bound = [0.2]
    fired = threading.Event()
    dog = Watchdog(lambda: bound[0], fired.set, recheck_s=0.05)
    bound[0] = 5.0  # more work arrived: the longer bound applies at once
    assert not fired.wait(0.5) and not dog.expired
    bound[0] = 0.1  # the work is done: the shorter one too
    assert fired.wait(2) and dog.expired and dog.expired_after == 0.1


def test_a_fed_watchdog_does_not_fire_and_stop_ends_it():
    fired = threading.Event()
    dog = Watchdog(0.3, fired.set, recheck_s=0.05)
    for _ in range(6):
        time.sleep(0.1)
        dog.feed()
    assert not dog.expired
    dog.stop()
    assert not fired.wait(0.5)
