"""The router's retry/resume policy, driven directly (no gRPC calls): which failure is retried on another pair,
which is resumed after the streamed tokens, which fails the caller with which status."""

import grpc
import pytest

from pdserve.router.retry_policy import Action, Decision, after_failure

C = grpc.StatusCode


def decide(code, streamed=0, attempt=0, max_attempts=3, active=True, left=10.0, details="boom"):
    return after_failure(
        code,
        details,
        attempt=attempt,
        max_attempts=max_attempts,
        streamed_tokens=streamed,
        caller_active=active,
        time_left_s=left,
    )


def test_unavailable_before_first_token_retries_and_blames():
    assert decide(C.UNAVAILABLE) == Decision(Action.RETRY, blame=True)


def test_unavailable_mid_stream_resumes_and_blames():
    assert decide(C.UNAVAILABLE, streamed=7) == Decision(Action.RESUME, blame=True)


def test_pool_full_before_first_token_retries_elsewhere_without_blame():
    assert decide(C.RESOURCE_EXHAUSTED) == Decision(Action.RETRY, blame=False)


def test_pool_full_mid_stream_fails_with_its_status():
    assert decide(C.RESOURCE_EXHAUSTED, streamed=3) == Decision(Action.FAIL, code=C.RESOURCE_EXHAUSTED, details="boom")


@pytest.mark.parametrize(
    "code", [C.INVALID_ARGUMENT, C.INTERNAL, C.DATA_LOSS, C.DEADLINE_EXCEEDED, C.FAILED_PRECONDITION]
)
def test_other_codes_fail_with_their_status_and_reason(code):
    assert decide(code, streamed=2) == Decision(Action.FAIL, code=code, details="boom")
    assert decide(code, details="").details == "decode failed"


def test_last_attempt_or_no_time_left_fails():
    assert decide(C.UNAVAILABLE, attempt=2, max_attempts=3) == Decision(Action.FAIL, code=C.UNAVAILABLE, details="boom")
    assert decide(C.UNAVAILABLE, attempt=1, max_attempts=3).action is Action.RETRY
    assert decide(C.RESOURCE_EXHAUSTED, attempt=0, max_attempts=1).action is Action.FAIL
    assert decide(C.UNAVAILABLE, streamed=4, left=0.0).action is Action.FAIL


def test_caller_gone_drops_whatever_the_code():
    for code in (C.UNAVAILABLE, C.RESOURCE_EXHAUSTED, C.CANCELLED, C.INTERNAL):
        assert decide(code, active=False) == Decision(Action.DROP)
