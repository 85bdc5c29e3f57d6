"""The token stream of `Decode.Generate`, shared by the disaggregated (`servicer.py`) and colocated
(`colocated.py`) servicers: the engine thread's outputs, taken from a queue, relayed as `DecodeResponse`s.

    generate_call(loop, rid, active, summary)    a call from admission on: counted, its engine request freed
    relay(outputs, context, deadline, what, req, cached_tokens, end, ...)   the messages, up to the last choice's end
    next_output(outputs, deadline, context, what)                          one item, or None: the caller left
    decode_response(out, req, cached_tokens, lead_logprobs, prompt)   the message of one output
    EarlyFirst(...).send(loop, rid, first)        the first token's message, ahead of its KV pages
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.engine.engine import StepOutput
from pdserve.engine.loop import EngineLoop
from pdserve.server.proto_convert import logprob_to_proto, prompt_logprobs_to_proto
from pdserve.telemetry.service import RequestScope
from pdserve.v1 import generate_pb2, internal_pb2


class CallerGone(Exception):
    """The caller cancelled (or its deadline passed) while KV pages were arriving: the request ends quietly."""


FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


def next_output(outputs: queue.Queue, deadline: float, context: grpc.ServicerContext, what: str) -> Any | None:
    """The next item the engine thread put into `outputs` (never None); None once the caller went away. Past
    `deadline` (time.monotonic()) the call ends with DEADLINE_EXCEEDED: "<what> exceeded its deadline"."""
    while True:
        try:
            return outputs.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if not context.is_active():
                return None
            if time.monotonic() > deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what} exceeded its deadline")


def decode_response(
    out: StepOutput,
    req: RequestScope,
    cached_tokens: int,
    lead_logprobs: list[generate_pb2.TokenLogprob],
    prompt: PromptScores,
) -> internal_pb2.DecodeResponse:
    """The message for one engine output: its tokens and text, `lead_logprobs` (already protos, e.g. the first
    token's from prefill) before its own, and the prompt's logprobs. A finished output also carries the finish and
    stop reasons and usage, and ends the request's telemetry."""
    msg = internal_pb2.DecodeResponse(
        token_ids=out.new_token_ids,
        text=out.text_delta,
        logprobs=[*lead_logprobs, *map(logprob_to_proto, out.logprobs)],
        prompt_logprobs=prompt.values,
        prompt_top_logprobs=prompt.tops,
        index=out.index,
    )
    req.first_token()
    if out.finished:  # this choice's end (n > 1: the request's once `request_done`)
        reason = out.finish_reason or "abort"  # always set on a finished output
        if out.request_done:
            req.finish(out.num_completion_tokens, reason, {"pdserve.cached_tokens": cached_tokens})
        msg.finish_reason = FINISH.get(reason, generate_pb2.FINISH_REASON_ABORT)
        msg.stop_reason = out.stop_reason or ""
        msg.usage.CopyFrom(
            generate_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                cached_tokens=cached_tokens,
                completion_tokens=out.num_completion_tokens,
            )
        )
        msg.unreturned_tokens = out.unreturned_tokens
    return msg


@dataclass
class PromptScores:
    """Prompt logprobs on their way to the caller, as the wire carries them: the values and, when the request asked
    for top_logprobs, their alternatives (from PrefillDone, or from the engine's outputs in colocated mode)."""

    values: list[float] = field(default_factory=list)
    tops: list[generate_pb2.TopLogprobs] = field(default_factory=list)

    def extend(self, values: Sequence[float], tops: Sequence[generate_pb2.TopLogprobs]) -> None:
        self.values.extend(values)
        self.tops.extend(tops)


@dataclass
class StreamEnd:
    """Where a relayed stream got to: whether its last output finished it, the finish reason ("abort" until then)
    and the completion tokens so far (for the call's summary line; unfinished: the engine request is aborted)."""

    finished: bool = False
    finish: str = "abort"
    completion_tokens: int = 0


def relay(
    outputs: queue.Queue,
    context: grpc.ServicerContext,
    deadline: float,
    what: str,
    req: RequestScope,
    cached_tokens: int,
    end: StreamEnd,
    lead_logprobs: Sequence[generate_pb2.TokenLogprob] = (),
    prompt: PromptScores | None = None,
) -> Iterator[internal_pb2.DecodeResponse]:
    """One message per engine output in `outputs` (StepOutputs, or the exception that failed the request: INTERNAL
    "<what> failed"), up to the finished one; nothing more once the caller went away (`next_output`). An output
    without tokens that does not finish (a prompt chunk) only adds its prompt logprobs: they lead the next message,
    after `prompt` (prefill's), as `lead_logprobs` (the first token's, from prefill) lead its logprobs. `end` follows
    the stream."""
    lead, prompt_lps = list(lead_logprobs), prompt or PromptScores()
    while True:
        out = next_output(outputs, deadline, context, what)
        if out is None:
            return
        if isinstance(out, BaseException):
            context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {out}")
        if out.prompt_logprobs:  # colocated: the engine scored prompt positions this step
            prompt_lps.extend(*prompt_logprobs_to_proto(out.prompt_logprobs))
        if not out.new_token_ids and not out.finished:
            continue  # a prompt chunk before the last: its prompt logprobs wait for the first token
        if end.completion_tokens < 2 <= out.num_completion_tokens:  # the second token's way out, on the trace
            req.event("second_token")
        end.completion_tokens = out.num_completion_tokens
        msg = decode_response(out, req, cached_tokens, lead, prompt_lps)
        lead, prompt_lps = [], PromptScores()
        if out.request_done:  # n > 1: every choice finished
            end.finished, end.finish = True, out.finish_reason or "abort"
        yield msg
        if end.finished:
            return


class EarlyFirst:
    """The first token of a Generate call streamed ahead of its KV pages (PrefillFirstToken): `send` appends it
    to the importing request and yields its response; afterwards `sent` is set and `end` follows it (a first token
    that ends the request finishes the call's stream; its pages still arrive, so prefill ends normally)."""

    def __init__(
        self, outputs: queue.Queue, context: grpc.ServicerContext, deadline: float, req: RequestScope, end: StreamEnd
    ):
        self.outputs, self.context, self.deadline, self.req, self.end = outputs, context, deadline, req, end
        self.sent = False
        self.forks = False  # n / best_of > 1: no first token ahead (the forks sample their own on decode)

    def send(
        self,
        loop: EngineLoop,
        rid: str,
        first: internal_pb2.PrefillFirstToken,
        on_emitted: Callable[[], None] | None = None,
    ) -> Iterator[internal_pb2.DecodeResponse]:
        """Raises InvalidRequest for a token the request cannot take (outside the vocabulary, twice).
        `on_emitted`: called once the engine took the token, before its response goes out."""
        loop.emit_first_token(rid, first.token_id)
        if on_emitted is not None:
            on_emitted()
        out = next_output(self.outputs, self.deadline, self.context, "decode")
        if out is None:
            raise CallerGone
        if isinstance(out, BaseException):
            self.context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {out}")
        self.sent = True
        self.end.completion_tokens = out.num_completion_tokens
        lead = [first.logprob] if first.HasField("logprob") else []
        msg = decode_response(out, self.req, first.cached_tokens, lead, PromptScores())
        if out.request_done:
            self.end.finished, self.end.finish = True, out.finish_reason or "abort"
        yield msg


class ActiveCalls:
    """How many Generate calls a servicer is serving (its Stats' active_requests); thread-safe."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def add(self, n: int) -> None:
        with self._lock:
            self._count += n


@contextmanager
def generate_call(
    loop: EngineLoop,
    rid: str,
    active: ActiveCalls,
    summary: Callable[[StreamEnd], None],
    context: grpc.ServicerContext | None = None,
    abort: Callable[[], object] | None = None,
) -> Iterator[StreamEnd]:
    """A Generate call from the admission of its engine request `rid` on, counted in `active`. However it ends,
    an engine request left unfinished is aborted (its pages freed) and `summary(end)` logs the call. With the call's
    `context`, a caller that cancels or whose deadline passes aborts the request at once, from gRPC's callback:
    its remaining prompt chunks and decode steps never run (the stream's reader notices only at its next poll).
    `abort`: how (default `loop.abort(rid)`), where the call may not own `rid` (its admission refused or not made)."""
    end = StreamEnd()
    live = threading.Event()  # set while this call owns `rid` in the engine (a later call may reuse the id)
    live.set()

    abort = abort or (lambda: loop.abort(rid))

    def caller_gone() -> None:
        if live.is_set() and not end.finished:
            abort()

    active.add(1)
    try:
        if context is not None and not context.add_callback(caller_gone):
            caller_gone()  # the RPC ended already
        yield end
    finally:
        live.clear()
        if not end.finished:
            abort()
        active.add(-1)
        summary(end)
