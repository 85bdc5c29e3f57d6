"""Failover resume of an n > 1 request: the decode instance streaming its choices went away after the caller got
some of them. Each unfinished choice resumes as a request of its own on the new pair, like an n = 1 resume: the
prompt + that choice's tokens so far (`resumed_tokens`, counted as completion; its structured-output grammar state
is replayed from them), the characters of their text already sent, and the choice's own generator (seed + index:
the engine samples choice i of a seeded request exactly as the request of n = 1 with that seed,
`pdserve.engine.forks`), so a resumed choice continues as if nothing happened, sampled or greedy. Their streams
merge into one, each message tagged with its choice's index, which `attempt.relay` relays as it did the forked
stream.

The prompt is then computed once per resumed choice instead of once (the prefill instance's prompt cache shares what
it holds): the price of a failover, paid only when one happens."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from pdserve.router.attempt import Progress
from pdserve.v1 import internal_pb2

Call = Iterator[internal_pb2.DecodeResponse]  # a grpc response stream (also has .cancel())


def choice_requests(
    base: internal_pb2.DecodeRequest, n: int, progress: Progress
) -> dict[int, internal_pb2.DecodeRequest]:
    """One n = 1 DecodeRequest per choice of `base` (the request's n > 1 DecodeRequest, as first sent) the caller
    has not seen end, continuing after what `progress` says it got of that choice. Request ids and the prefill
    target are the attempt's to set."""
    prompt = list(base.prompt_token_ids)
    out = {}
    for index in range(n):
        got = progress.choices.get(index)
        if got is not None and got.finished:
            continue
        req = internal_pb2.DecodeRequest()
        req.CopyFrom(base)
        req.n, req.best_of = 0, 0
        tokens = got.tokens if got is not None else []
        del req.prompt_token_ids[:]
        req.prompt_token_ids.extend(prompt + tokens)
        req.resumed_tokens = len(tokens)
        req.resumed_text_chars = got.chars if got is not None else 0
        req.sampling.prompt_logprobs = False  # the caller has them (the stream's first chunk)
        if req.sampling.HasField("seed"):
            req.sampling.seed = (req.sampling.seed + index) % 2**64
        out[index] = req
    return out


class MergedCalls:
    """Several decode calls (one per choice) as one stream of DecodeResponses, each tagged with its choice's index,
    in arrival order. The first call to fail fails the stream (its grpc.RpcError) and cancels the others; `cancel`
    cancels them all (the caller went away)."""

    _END = object()

    def __init__(self, calls: dict[int, Call]):
        self._calls = calls
        self._queue: queue.Queue = queue.Queue()
        for index, call in calls.items():
            threading.Thread(target=self._pump, args=(index, call), daemon=True, name=f"choice-{index}").start()

    def _pump(self, index: int, call: Call) -> None:
        try:
            for msg in call:
                msg.index = index
                self._queue.put(msg)
            self._queue.put(self._END)
        except grpc.RpcError as e:
            self._queue.put(e)

    def __iter__(self) -> Iterator[internal_pb2.DecodeResponse]:
        left = len(self._calls)
        try:
            while left:
                item = self._queue.get()
                if item is self._END:
                    left -= 1
                elif isinstance(item, grpc.RpcError):
                    raise item
                else:
                    yield item
        finally:
            self.cancel()  # a failed or abandoned stream: its other calls end too (a no-op on finished ones)

    def cancel(self) -> None:
        for call in self._calls.values():
            call.cancel()  # type: ignore[attr-defined]


def start_choice_calls(
    requests: dict[int, internal_pb2.DecodeRequest], start: Callable[[internal_pb2.DecodeRequest], Call]
) -> MergedCalls:
    """Start one call per choice (`start(request)`: the decode stub's Generate with the attempt's timeout and
    metadata) and merge them."""
    return MergedCalls({index: start(req) for index, req in requests.items()})
