"""The SDK's RESOURCE_EXHAUSTED retry policy (pure; the SDK against a real router: test_router_cluster.py)."""

import random
import time

import grpc

from pdserve.client_retry import RetryPolicy, pushback_s


class Err(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.RESOURCE_EXHAUSTED, trailers=()):
        self._code, self._trailers = code, tuple(trailers)

    def code(self):
        return self._code

    def trailing_metadata(self):
        return self._trailers


def test_pushback_prefers_grpc_key_and_honours_do_not_retry():
    assert pushback_s(Err(trailers=[("grpc-retry-pushback-ms", "250"), ("retry-after-ms", "900")])) == 0.25
    assert pushback_s(Err(trailers=[("retry-after-ms", "900")])) == 0.9
    assert pushback_s(Err()) is None
    assert pushback_s(Err(trailers=[("grpc-retry-pushback-ms", "-1")])) == -1.0
    assert pushback_s(Err(trailers=[("grpc-retry-pushback-ms", "soon")])) == -1.0


def test_delay_follows_pushback_within_bounds():
    pol = RetryPolicy(max_attempts=4, max_wait_s=1.0, jitter=0.0)
    err = Err(trailers=[("grpc-retry-pushback-ms", "300")])
    assert pol.delay(err, 1, 0.0, None) == 0.3
    assert pol.delay(err, 3, 0.6, None) == 0.3
    assert pol.delay(err, 4, 0.0, None) is None  # attempts used up
    assert pol.delay(err, 2, 0.8, None) is None  # would wait past max_wait_s in total
    assert pol.delay(err, 1, 0.0, time.monotonic() + 0.2) is None  # would sleep past the call's deadline
    assert pol.delay(Err(trailers=[("grpc-retry-pushback-ms", "-1")]), 1, 0.0, None) is None
    assert pol.delay(Err(), 1, 0.0, None) is None  # no pushback: gRPC's own (message too large), not retried
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert pol.delay(Err(code, [("grpc-retry-pushback-ms", "10")]), 1, 0.0, None) is None


def test_jitter_only_lengthens_and_is_bounded():
    pol = RetryPolicy(jitter=0.5, rng=random.Random(1))
    err = Err(trailers=[("retry-after-ms", "100")])
    delays = [pol.delay(err, 1, 0.0, None) for _ in range(200)]
    assert all(0.1 <= d <= 0.15 for d in delays) and len(set(delays)) > 100


def test_small_pushbacks_back_off_so_a_burst_is_outlasted():
    """A router that keeps saying "in 1 ms" must not exhaust the attempts in a few milliseconds: the floor grows
    per attempt and the retries together span the time budget (what rejected a burst of 32 clients on the H200)."""
    pol = RetryPolicy(jitter=0.0)
    err = Err(trailers=[("grpc-retry-pushback-ms", "1")])
    waited, attempt, delays = 0.0, 1, []
    while (d := pol.delay(err, attempt, waited, None)) is not None:
        delays.append(d)
        waited += d
        attempt += 1
    assert delays[0] == pol.min_delay_s and delays == sorted(delays)  # a pushback is a floor, never shortened
    assert max(delays) == pol.max_delay_s
    assert waited > 0.8 * pol.max_wait_s  # the time budget, not the attempt count, ends the retries
