"""One attempt of a router request: relay the chosen decode instance's stream to the caller, keeping what the
caller has received across attempts (the tokens and characters a resume continues after, the TTFT)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import generate_pb2, internal_pb2


@dataclass
class ChoiceProgress:
    """What the caller has been sent of one choice (n > 1: each resumes on its own, `choice_resume`)."""

    tokens: list[int] = field(default_factory=list)
    chars: int = 0
    finished: bool = False


@dataclass
class Progress:
    """What the caller has been sent, over every attempt of one request."""

    t0: float  # perf_counter at the request's arrival
    tokens: list[int] = field(default_factory=list)  # token ids streamed, every choice's (n = 1: a resume's prompt)
    chars: int = 0  # characters of text streamed
    ttft_ms: float | None = None
    finish: str = "abort"  # FinishReason name once the final chunk went out
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)  # by DecodeResponse.index
    unreturned_tokens: int = 0  # best_of > n: completion tokens of the candidates not returned (usage counts them)

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def delivered(self) -> bool:
        """The caller got something a retry from scratch would send again (a token, or a choice's end)."""
        return bool(self.tokens) or any(c.finished for c in self.choices.values())

    def forget(self) -> None:
        """A retry from scratch of output the caller has not seen (best_of > n, held until the attempt ends)."""
        self.tokens, self.chars, self.choices, self.unreturned_tokens = [], 0, {}, 0


@dataclass
class AttemptHooks:
    """Called by `relay` before the chunk that triggers them is yielded."""

    attempt_first_token: Callable[[], None]  # this pair's prefill is done
    first_token: Callable[[], None]  # the caller's first token (once per request)
    finished: Callable[[internal_pb2.DecodeResponse], None]  # the final chunk (usage, finish reason)


class AttemptAborted(grpc.RpcError):
    """A decode stream that ended OK but with finish reason ABORT: the engine dropped the request (it was cancelled
    or failed underneath this call). Never relayed as the caller's finish; the router retries or resumes it like
    an UNAVAILABLE instance."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def relay(
    call: Iterable[internal_pb2.DecodeResponse], rid: str, progress: Progress, hooks: AttemptHooks
) -> Iterator[generate_pb2.GenerateStreamResponse]:
    """Yield the caller's chunks for one attempt's DecodeResponses, updating `progress`. The call's
    grpc.RpcError propagates (with `progress` telling how far the caller got); an ABORT finish raises
    AttemptAborted."""
    first_of_attempt = True
    for msg in call:
        out = generate_pb2.GenerateStreamResponse(
            request_id=rid, token_ids=msg.token_ids, text=msg.text, logprobs=msg.logprobs, index=msg.index
        )
        if msg.prompt_logprobs:
            out.prompt_logprobs.logprobs.extend(msg.prompt_logprobs)
            out.prompt_logprobs.top.extend(msg.prompt_top_logprobs)
        now_ms = progress.elapsed_ms()
        if first_of_attempt:
            first_of_attempt = False
            hooks.attempt_first_token()
        if progress.ttft_ms is None:
            progress.ttft_ms = now_ms
            hooks.first_token()
            out.timing.ttft_ms = now_ms
        progress.tokens.extend(msg.token_ids)
        progress.chars += len(msg.text)
        choice = progress.choices.setdefault(msg.index, ChoiceProgress())
        choice.tokens.extend(msg.token_ids)
        choice.chars += len(msg.text)
        if msg.finish_reason == generate_pb2.FINISH_REASON_ABORT:
            if msg.token_ids or msg.text:  # what came with it is the caller's; the resume continues after it
                yield out
            raise AttemptAborted("decode ended the stream with finish reason ABORT (request dropped by its engine)")
        if msg.finish_reason:
            choice.finished = True
            progress.unreturned_tokens += msg.unreturned_tokens
            progress.finish = generate_pb2.FinishReason.Name(msg.finish_reason)
            out.finish_reason = msg.finish_reason
            out.stop_reason = msg.stop_reason
            out.usage.CopyFrom(msg.usage)
            out.timing.ttft_ms = progress.ttft_ms
            out.timing.total_ms = now_ms
            hooks.finished(msg)
        yield out
