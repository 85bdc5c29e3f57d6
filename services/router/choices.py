"""n > 1 on the router (GenerateRequest.n / best_of): the decode instance streams every choice's messages over the
one call (DecodeResponse.index); the caller gets them as chunks with `index`, each choice shaped on its own (its
token texts, reasoning split and tool-call parse: `ChoiceShaping`), each ending with its own finish_reason, and the
request's usage (the prompt once, every choice's completion tokens) on the last chunk (`RequestUsage`), or one
GenerateResponse with every choice (`merge_choices`; best_of > n: usage counts every candidate's tokens). A decode
instance lost mid-stream: the unfinished choices resume (`choice_resume`)."""

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


def pipeline(stages: list[Shape]) -> Shape:
    """The stages applied in turn to a whole stream (n = 1)."""

    def shape(chunks: Chunks) -> Iterator[generate_pb2.GenerateStreamResponse]:
        for stage in stages:
            chunks = stage(chunks)
        yield from chunks

    return shape


class RequestUsage:
    """A stream of n > 1 choices: each choice's last chunk carries that choice's usage from decode; the stream's
    last one gets the request's instead (prompt and cached tokens once, every choice's completion tokens), the
    others none. Counts across attempts (a failover resumes the unfinished choices only)."""

    def __init__(self, n: int):
        self.n, self.finished, self.completion = n, 0, 0

    def shape(self, chunks: Chunks) -> Iterator[generate_pb2.GenerateStreamResponse]:
        for chunk in chunks:
            if chunk.finish_reason:
                self.finished += 1
                self.completion += chunk.usage.completion_tokens
                if self.finished == self.n:
                    chunk.usage.completion_tokens = self.completion
                else:
                    chunk.ClearField("usage")
            yield chunk


def merge_choices(chunks: Chunks, n: int, unreturned: Callable[[], int] = lambda: 0) -> generate_pb2.GenerateResponse:
    """One GenerateResponse of a stream of `n` choices: n = 1 as `merge_chunks`; else the top-level fields are choice
    0's, `choices` every choice in index order (each with its own usage), `usage` the request's. `unreturned()`,
    asked once the stream is consumed: best_of > n, the candidates' completion tokens not returned, which the
    request's usage counts (OpenAI bills every candidate)."""
    if n == 1:
        resp = merge_chunks(chunks)
        resp.usage.completion_tokens += unreturned()
        return resp
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
    top.usage.completion_tokens = sum(c.usage.completion_tokens for c in choices) + unreturned()
    top.timing.total_ms = max(c.timing.total_ms for c in choices)
    top.choices.extend(choices)
    return top
