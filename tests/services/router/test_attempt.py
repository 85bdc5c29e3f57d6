"""The attempt relay over plain iterables (no gRPC): chunks relayed with TTFT once per request, progress kept
across attempts (what a resume continues from), hooks in order, the call's error propagating mid-stream."""

import time

import grpc
import pytest

from pdserve.router.attempt import AttemptHooks, Progress, relay
from pdserve.v1 import generate_pb2, internal_pb2


class Broken(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "decode went away"


def chunks(*token_lists, finish=0, then_fail=False):
    for i, ids in enumerate(token_lists):
        last = i == len(token_lists) - 1
        msg = internal_pb2.DecodeResponse(token_ids=ids, text="x" * len(ids))
        if last and finish:
            msg.finish_reason = finish
            msg.usage.completion_tokens = 99
        yield msg
    if then_fail:
        raise Broken()


def recorder():
    events = []
    hooks = AttemptHooks(
        attempt_first_token=lambda: events.append("attempt_first"),
        first_token=lambda: events.append("first"),
        finished=lambda msg: events.append(("finished", msg.usage.completion_tokens)),
    )
    return events, hooks


def test_one_attempt_relays_every_chunk_and_finishes():
    events, hooks = recorder()
    progress = Progress(time.perf_counter())
    out = list(relay(chunks([1], [2, 3], [4], finish=generate_pb2.FINISH_REASON_LENGTH), "r", progress, hooks))
    assert [list(o.token_ids) for o in out] == [[1], [2, 3], [4]]
    assert all(o.request_id == "r" for o in out)
    assert out[0].timing.ttft_ms == progress.ttft_ms > 0 and not out[1].HasField("timing")
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == 99
    assert out[-1].timing.total_ms >= out[-1].timing.ttft_ms
    assert progress.tokens == [1, 2, 3, 4] and progress.chars == 4 and progress.finish == "FINISH_REASON_LENGTH"
    assert events == ["attempt_first", "first", ("finished", 99)]


def test_failed_attempt_keeps_progress_and_the_resume_continues_it():
    events, hooks = recorder()
    progress = Progress(time.perf_counter())
    got = []
    with pytest.raises(Broken):
        for o in relay(chunks([1], [2, 3], then_fail=True), "r", progress, hooks):
            got.append(o)
    assert progress.tokens == [1, 2, 3] and progress.chars == 3 and progress.finish == "abort"
    ttft = progress.ttft_ms
    out = list(relay(chunks([4], [5], finish=generate_pb2.FINISH_REASON_STOP), "r", progress, hooks))
    assert progress.tokens == [1, 2, 3, 4, 5] and progress.ttft_ms == ttft
    assert not out[0].HasField("timing")  # TTFT only on the request's first chunk
    assert out[-1].timing.ttft_ms == ttft
    # each attempt's first chunk ends that pair's prefill; the caller's first token is reported once
    assert events == ["attempt_first", "first", "attempt_first", ("finished", 99)]


def test_attempt_failing_before_any_chunk_leaves_no_progress():
    events, hooks = recorder()
    progress = Progress(time.perf_counter())
    with pytest.raises(Broken):
        list(relay(chunks(then_fail=True), "r", progress, hooks))
    assert progress.tokens == [] and progress.ttft_ms is None and events == []


def test_abort_finish_is_never_relayed_as_the_callers_finish():
    """A decode stream ending OK with finish reason ABORT (its engine dropped the request) raises an UNAVAILABLE
    AttemptAborted after relaying what came with it: the router resumes instead of ending the caller's stream with
    an empty ABORT (the silent loss the prefill-kill scenario found)."""
    from pdserve.router.attempt import AttemptAborted

    events, hooks = recorder()
    progress = Progress(time.perf_counter())
    got = []
    with pytest.raises(AttemptAborted) as err:
        for out in relay(chunks([1, 2], [3], finish=generate_pb2.FINISH_REASON_ABORT), "r", progress, hooks):
            got.append(out)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [list(o.token_ids) for o in got] == [[1, 2], [3]] and not any(o.finish_reason for o in got)
    assert progress.tokens == [1, 2, 3] and progress.finish == "abort"
    assert not any(isinstance(e, tuple) for e in events)  # `finished` never called
