"""The token stream of `Decode.Generate`, shared by the disaggregated (`servicer.py`) and colocated
(`colocated.py`) servicers: waiting for the engine thread's outputs and turning them into `DecodeResponse`s."""

from __future__ import annotations

import queue
import time
from typing import Any

import grpc

from pdserve.engine.engine import StepOutput
from pdserve.server.proto_convert import logprob_to_proto
from pdserve.telemetry.service import RequestScope
from pdserve.v1 import generate_pb2, internal_pb2

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
    prompt_logprobs: list[float],
) -> internal_pb2.DecodeResponse:
    """The message for one engine output: its tokens and text, `lead_logprobs` (already protos, e.g. the first
    token's from prefill) before its own, and the prompt's logprobs. A finished output also carries the finish and
    stop reasons and usage, and ends the request's telemetry."""
    msg = internal_pb2.DecodeResponse(
        token_ids=out.new_token_ids,
        text=out.text_delta,
        logprobs=[*lead_logprobs, *map(logprob_to_proto, out.logprobs)],
        prompt_logprobs=prompt_logprobs,
    )
    req.first_token()
    if out.finished:
        reason = out.finish_reason or "abort"  # always set on a finished output
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
    return msg
