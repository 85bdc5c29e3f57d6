"""The router's resume of an n > 1 request (choice_resume.py), without gRPC: a request per unfinished choice from
what the caller got (its tokens as the prompt's tail, their characters, its own seed), the choices' calls merged
into one tagged stream that fails with the first call's error; and the request's usage counted across attempts."""

import threading
import time

import grpc
import pytest

from pdserve.router.attempt import AttemptHooks, Progress, relay
from pdserve.router.choice_resume import MergedCalls, choice_requests
from pdserve.router.choices import RequestUsage, merge_choices
from pdserve.v1 import generate_pb2, internal_pb2

LENGTH = generate_pb2.FINISH_REASON_LENGTH


class Broken(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "decode went away"


class Call:
    """A decode call's messages (then `error`, if any) that records being cancelled; `gate` holds it before its
    first message."""

    def __init__(self, msgs, error=None, gate: threading.Event | None = None):
        self.msgs, self.error, self.gate = msgs, error, gate
        self.cancelled = threading.Event()

    def __iter__(self):
        if self.gate is not None:
            self.gate.wait(10)
        yield from self.msgs
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled.set()


def msg(tokens, finish=0, completion=0, index=0):
    m = internal_pb2.DecodeResponse(token_ids=tokens, text="ab" * len(tokens), index=index, finish_reason=finish)
    if finish:
        m.usage.completion_tokens = completion
    return m


def hooks():
    return AttemptHooks(lambda: None, lambda: None, lambda m: None)


def test_a_request_per_unfinished_choice_continuing_where_the_caller_is():
    base = internal_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3], n=4, cache_scope="t")
    base.sampling.seed = 2**64 - 2
    base.sampling.prompt_logprobs = True
    progress = Progress(time.perf_counter())
    stream = [msg([7, 8], index=0), msg([9], index=2), msg([5], LENGTH, 1, index=1), msg([6], index=0)]
    list(relay(iter(stream), "label", progress, hooks()))
    reqs = choice_requests(base, 4, progress)
    assert sorted(reqs) == [0, 2, 3]  # choice 1 ended: the caller has all of it
    assert list(reqs[0].prompt_token_ids) == [1, 2, 3, 7, 8, 6] and reqs[0].resumed_tokens == 3
    assert reqs[0].resumed_text_chars == 6 and reqs[2].resumed_text_chars == 2
    assert list(reqs[3].prompt_token_ids) == [1, 2, 3] and reqs[3].resumed_tokens == 0  # nothing seen yet
    assert [reqs[i].sampling.seed for i in (0, 2, 3)] == [2**64 - 2, 0, 1]  # seed + index, wrapping at 2^64
    for r in reqs.values():
        assert (r.n, r.best_of, r.cache_scope, r.sampling.prompt_logprobs) == (0, 0, "t", False)
    unseeded = internal_pb2.DecodeRequest(prompt_token_ids=[1], n=2)
    assert not any(r.sampling.HasField("seed") for r in choice_requests(unseeded, 2, Progress(0.0)).values())


def test_merged_calls_tag_each_choice_and_fail_with_the_first_error():
    ok = {0: Call([msg([1]), msg([2], LENGTH, 3)]), 2: Call([msg([4]), msg([5], LENGTH, 9)])}
    merged = list(MergedCalls(ok))
    assert sorted((m.index, list(m.token_ids)) for m in merged) == [(0, [1]), (0, [2]), (2, [4]), (2, [5])]
    gate = threading.Event()
    calls = {0: Call([msg([1])], error=Broken()), 1: Call([msg([2])], gate=gate)}
    got = []
    with pytest.raises(Broken):
        for m in MergedCalls(calls):
            got.append(m.index)
    assert got.count(0) == 1 and calls[1].cancelled.is_set()  # the other choice's call is cancelled
    gate.set()


def test_request_usage_counts_choices_across_attempts_and_best_of_candidates():
    usage = RequestUsage(3)
    ends = []
    for attempt in ([(1, 4)], [(0, 5), (2, 6)]):  # choice 1 ended before the failover, 0 and 2 after it
        batch = []
        for i, n in attempt:
            c = generate_pb2.GenerateStreamResponse(index=i, finish_reason=LENGTH)
            c.usage.completion_tokens = n
            batch.append(c)
        ends += list(usage.shape(iter(batch)))
    assert [e.HasField("usage") for e in ends] == [False, False, True] and ends[-1].usage.completion_tokens == 15
    one = generate_pb2.GenerateStreamResponse(token_ids=[1, 2], finish_reason=LENGTH)
    one.usage.completion_tokens = 2
    assert merge_choices(iter([one]), 1, lambda: 4).usage.completion_tokens == 6  # best_of 3: two more ran 2 each
