"""Python SDK: `pdserve.Client` (blocking) and `pdserve.AsyncClient` (asyncio) for the router's Generation API.

    with pdserve.Client("localhost:50051") as c:
        out = c.generate(prompt="hello", max_tokens=32, temperature=0)
        print(out.text, out.finish_reason, out.usage)
        for chunk in c.stream(prompt="hello"):
            print(chunk.text, end="")

Errors are `grpc.RpcError` with the server's status code and reason (e.g. INVALID_ARGUMENT).
`metadata=` (per client and per call) is sent as gRPC metadata: a W3C `traceparent` there is continued by the
server's trace (router → decode → prefill), see docs/tracing.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.server.grpc_util import CHANNEL_OPTIONS
from pdserve.v1 import generate_pb2, generate_pb2_grpc

_FINISH = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}
_PRIORITY = {
    None: generate_pb2.PRIORITY_UNSPECIFIED,
    "low": generate_pb2.PRIORITY_LOW,
    "normal": generate_pb2.PRIORITY_NORMAL,
    "high": generate_pb2.PRIORITY_HIGH,
}


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class CompletionChunk:
    """One streamed piece: new token ids and text; `finish_reason` is set on the last chunk."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str = ""
    usage: Usage | None = None
    ttft_ms: float | None = None


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]  # completion only
    finish_reason: str | None
    stop_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    ttft_ms: float | None = None
    total_ms: float | None = None


def build_request(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    request_id: str | None = None,
    priority: str | None = None,
) -> generate_pb2.GenerateRequest:
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise ValueError("pass exactly one of prompt=, token_ids= or messages=")
    s = generate_pb2.SamplingParams(
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(s, name, value)
    req = generate_pb2.GenerateRequest(request_id=request_id or "", sampling=s, priority=_PRIORITY[priority])
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:  # [{"role": ..., "content": ...}], rendered by the router's chat template
        req.messages.extend(generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        req.token_ids.ids.extend(token_ids)
    return req


def _chunk(msg: generate_pb2.GenerateStreamResponse) -> CompletionChunk:
    last = msg.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    return CompletionChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH.get(msg.finish_reason) if last else None,
        stop_reason=msg.stop_reason,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.cached_tokens, msg.usage.completion_tokens) if last else None,
        ttft_ms=msg.timing.ttft_ms if msg.HasField("timing") and msg.timing.ttft_ms else None,
    )


def _completion(msg: generate_pb2.GenerateResponse) -> Completion:
    return Completion(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=list(msg.token_ids),
        finish_reason=_FINISH.get(msg.finish_reason),
        stop_reason=msg.stop_reason,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.cached_tokens, msg.usage.completion_tokens),
        ttft_ms=msg.timing.ttft_ms,
        total_ms=msg.timing.total_ms,
    )


class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of each call."""

    def __init__(
        self, target: str = "localhost:50051", *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ):
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self.timeout = timeout
        self.metadata = list(metadata)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> Completion:
        resp = self._stub.Generate(
            build_request(prompt, **kw), timeout=timeout or self.timeout, metadata=[*self.metadata, *metadata]
        )
        return _completion(resp)

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> Iterator[CompletionChunk]:
        call = self._stub.GenerateStream(
            build_request(prompt, **kw), timeout=timeout or self.timeout, metadata=[*self.metadata, *metadata]
        )
        try:
            for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()  # no-op when finished; stops generation when the caller breaks out early

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods as `Client`."""

    def __init__(
        self, target: str = "localhost:50051", *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ):
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self.timeout = timeout
        self.metadata = list(metadata)

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> Completion:
        resp = await self._stub.Generate(
            build_request(prompt, **kw), timeout=timeout or self.timeout, metadata=[*self.metadata, *metadata]
        )
        return _completion(resp)

    async def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> AsyncIterator[CompletionChunk]:
        call = self._stub.GenerateStream(
            build_request(prompt, **kw), timeout=timeout or self.timeout, metadata=[*self.metadata, *metadata]
        )
        try:
            async for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
