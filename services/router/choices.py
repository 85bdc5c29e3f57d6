"""n > 1 on the router (GenerateRequest.n / best_of): the decode instance streams every choice's messages over the
one call (DecodeResponse.index); the caller gets them as chunks with `index`, each choice shaped on its own (its
token texts, reasoning split and tool-call parse: `ChoiceShaping`), each ending with its own finish_reason, and the
request's usage (the prompt once, every choice's completion tokens) on the last chunk (`request_usage`), or one
GenerateResponse with every choice (`merge_choices`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from pdserve.engine.request_limits import MAX_N
from pdserve.errors import InvalidRequest
from pdserve.router.shaping import merge_chunks
from pdserve.v1 import generate_pb2

Chunks = Iterable[generate_pb2.GenerateStreamResponse]
Shape = Callable[[Chunks], Iterator[generate_pb2.GenerateStreamResponse]]


def choice_counts(request: generate_pb2.GenerateRequest, stream: bool) -> tuple[int, int]:
    """(n, best_of) of a request (unset: 1, n); InvalidRequest outside 1 <= n <= best_of <= MAX_N, and for
    best_of > n on a stream (the best are known only at the end; OpenAI refuses it too)."""
    n = request.n or 1
    best_of = request.best_of or n
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {request.n}")
    if not n <= best_of <= MAX_N:
        raise InvalidRequest(f"best_of must be in [n, {MAX_N}] (n = {n}), got {request.best_of}")
    if stream and best_of > n:
        raise InvalidRequest("best_of > n cannot be streamed (the best are known at the end): use Generate")
    return n, best_of


class ChoiceShaping:
    """Each choice's chunks through its own shapers (`new_shapers()`: a fresh pipeline of per-chunk stages)."""

    def __init__(self, new_shapers: Callable[[], list[Shape]]):
        self._new = new_shapers
        self._stages: dict[int, list[Shape]] = {}

    def shape(self, chunks: Chunks) -> Iterator[generate_pb2.GenerateStreamResponse]:
        for chunk in chunks:
            stages = self._stages.get(chunk.index)
            if stages is None:
                stages = self._stages[chunk.index] = self._new()
            out: list[generate_pb2.GenerateStreamResponse] = [chunk]
            for stage in stages:  # each stage yields one chunk per chunk
                out = list(stage(out))
            yield from out


def request_usage(chunks: Chunks, n: int) -> Iterator[generate_pb2.GenerateStreamResponse]:
    """A stream of n > 1 choices: each choice's last chunk carries that choice's usage from decode; the stream's
    last one gets the request's instead (prompt and cached tokens once, every choice's completion tokens), the
    others none."""
    finished, completion = 0, 0
    for chunk in chunks:
        if chunk.finish_reason:
            finished += 1
            completion += chunk.usage.completion_tokens
            if finished == n:
                chunk.usage.completion_tokens = completion
            else:
                chunk.ClearField("usage")
        yield chunk


def merge_choices(chunks: Chunks, n: int) -> generate_pb2.GenerateResponse:
    """One GenerateResponse of a stream of `n` choices: n = 1 as `merge_chunks`; else the top-level fields are choice
    0's, `choices` every choice in index order (each with its own usage), `usage` the request's."""
    if n == 1:
        return merge_chunks(chunks)
    by_index: dict[int, list[generate_pb2.GenerateStreamResponse]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    choices = []
    for index in sorted(by_index):
        resp = merge_chunks(by_index[index])
        resp.index = index
        choices.append(resp)
    top = generate_pb2.GenerateResponse()
    if not choices:
        return top
    top.CopyFrom(choices[0])
    scored = next((c for c in choices if c.HasField("prompt_logprobs")), None)  # on the stream's first chunk
    if scored is not None:
        top.prompt_logprobs.CopyFrom(scored.prompt_logprobs)
    top.usage.completion_tokens = sum(c.usage.completion_tokens for c in choices)
    top.timing.total_ms = max(c.timing.total_ms for c in choices)
    top.choices.extend(choices)
    return top
