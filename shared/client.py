"""Python SDK: `pdserve.Client` (blocking) and `pdserve.AsyncClient` (asyncio) for the router's Generation API.

    with pdserve.Client("localhost:50051") as c:
        out = c.generate(prompt="hello", max_tokens=32, temperature=0)
        print(out.text, out.finish_reason, out.usage)
        for chunk in c.stream(prompt="hello"):
            print(chunk.text, end="")
        reply = c.chat([{"role": "user", "content": "hi"}])  # rendered with the model's chat template
        for chunk in c.chat(messages, stream=True): ...
        scored = c.generate(prompt="2+2=", logprobs=True, top_logprobs=5, prompt_logprobs=True)
        typed = c.generate(prompt="Name: ", json_schema={"type": "object", ...}, frequency_penalty=0.5)

Defaults: max_tokens unset is 16 for prompt= / token_ids= and "until EOS or the context ends" for messages= (the
OpenAI defaults of /v1/completions and /v1/chat/completions); temperature / top_p / top_k unset are the served
model's (its generation_config.json, applied by the router), else 1.0 / 1.0 / off. Log-probabilities are the
model's distribution before temperature / top-k / top-p. Reasoning models: `reasoning_text` holds the `<think>`
part, `text` the answer.

Errors are `grpc.RpcError` with the server's status code and reason (e.g. INVALID_ARGUMENT). RESOURCE_EXHAUSTED
(the router at capacity) is retried after the server's pushback, bounded (`retry=RetryPolicy(...)`, `retry=False`
to turn it off; streams only before their first chunk; `pdserve.client_retry`).
`metadata=` (per client and per call) is sent as gRPC metadata: a W3C `traceparent` there is continued by the
server's trace (router → decode → prefill), see docs/tracing.md.

Security (docs/security.md): `token=` is sent as `authorization: Bearer <token>` (the router maps it to a tenant);
`tls_ca=` (a PEM path or bytes; `tls=True` alone: the system roots) makes the channel TLS, `tls_cert=`/`tls_key=`
add a client certificate.

    with pdserve.Client("router.example:50051", token="...", tls_ca="ca.pem") as c: ...
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import grpc

from pdserve.client_retry import RetryPolicy
from pdserve.client_tools import ToolCall, ToolCallDelta, add_tools, chat_message, tool_call_deltas, tool_calls
from pdserve.server.auth import bearer_metadata
from pdserve.server.grpc_util import CHANNEL_OPTIONS, SYNC_CHANNEL_OPTIONS
from pdserve.v1 import generate_pb2, generate_pb2_grpc

_FINISH = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
    generate_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
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
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    """A generated token's log-probability (the model's distribution, before temperature) and the top ones."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """The prompt scored by the model: logprobs[i] = log P(token_ids[i + 1] | token_ids[: i + 1]); with
    `top_logprobs=N`, top[i] holds the N most likely tokens at that position (most likely first)."""

    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    top: list[list[TopLogprob]] = field(default_factory=list)


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
    reasoning_text: str = ""  # new thinking text (reasoning models; `text` is the answer)
    logprobs: list[TokenLogprob] | None = None  # one per token id (logprobs=True / top_logprobs=N)
    prompt_logprobs: PromptLogprobs | None = None  # on the first chunk (prompt_logprobs=True)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # pieces of tool calls (tools=); `text` is the rest
    index: int = 0  # the choice (n > 1: the choices' chunks interleave, each ends with its finish_reason)


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
    reasoning_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # the calls the model made (tools=)
    index: int = 0  # the choice
    choices: list[Completion] = field(default_factory=list)  # n > 1: every choice (this one's fields: choice 0's)


def build_request(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, Any]] | None = None,
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
    logprobs: bool = False,
    top_logprobs: int | None = None,
    prompt_logprobs: bool = False,
    max_reasoning_tokens: int | None = None,
    split_reasoning: bool | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    stream_usage: bool = False,
    model: str = "",
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    n: int | None = None,
    best_of: int | None = None,
) -> generate_pb2.GenerateRequest:
    """The GenerateRequest of these arguments. Structured output: at most one of `json_schema` (a dict or its JSON
    text), `json_object`, `regex`, `choice`, `grammar` (EBNF). `stream_usage`: running usage on every chunk.
    `model`: the served model to run (`list_models()`; "" = the router's only one). Tools (messages only; OpenAI's
    shapes, `pdserve.client_tools`): `tools`, `tool_choice` ("auto", "none", "required" or {"type": "function",
    "function": {"name": ...}}), `parallel_tool_calls`; tool turns in `messages` carry `tool_calls` /
    `tool_call_id`. `n`: completions of the prompt (choices, 1..16), out of `best_of` candidates (the highest
    cumulative logprob; best_of > n: generate only)."""
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise ValueError("pass exactly one of prompt=, token_ids= or messages=")
    s = generate_pb2.SamplingParams(
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        logit_bias=dict(logit_bias or {}),
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("max_reasoning_tokens", max_reasoning_tokens),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty),
        ("min_tokens", min_tokens),
    ):
        if value is not None:
            setattr(s, name, value)
    structured = _structured(json_schema, json_object, regex, choice, grammar)
    if structured is not None:
        s.structured.CopyFrom(structured)
    req = generate_pb2.GenerateRequest(
        request_id=request_id or "",
        sampling=s,
        priority=_PRIORITY[priority],
        stream_usage=stream_usage,
        model=model,
        n=n or 0,
        best_of=best_of or 0,
    )
    if split_reasoning is not None:
        req.split_reasoning = split_reasoning
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:  # [{"role": ..., "content": ...}], rendered by the router's chat template
        req.messages.extend(chat_message(m) for m in messages)
    else:
        req.token_ids.ids.extend(token_ids)
    add_tools(req, tools, tool_choice, parallel_tool_calls)
    return req


def _structured(
    json_schema: dict | str | None,
    json_object: bool,
    regex: str | None,
    choice: Sequence[str] | None,
    grammar: str | None,
) -> generate_pb2.StructuredOutput | None:
    given = [json_schema is not None, json_object, regex is not None, choice is not None, grammar is not None]
    if sum(given) > 1:
        raise ValueError("pass at most one of json_schema=, json_object=, regex=, choice= or grammar=")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return generate_pb2.StructuredOutput(json_schema=text)
    if json_object:
        return generate_pb2.StructuredOutput(json_object=True)
    if regex is not None:
        return generate_pb2.StructuredOutput(regex=regex)
    if choice is not None:
        return generate_pb2.StructuredOutput(choice=generate_pb2.ChoiceList(choices=list(choice)))
    if grammar is not None:
        return generate_pb2.StructuredOutput(grammar=grammar)
    return None


def _logprobs(msg) -> list[TokenLogprob] | None:
    if not msg.logprobs:
        return None
    return [TokenLogprob(lp.token_id, lp.token, lp.logprob, [_top_logprob(t) for t in lp.top]) for lp in msg.logprobs]


def _top_logprob(t: generate_pb2.TopLogprob) -> TopLogprob:
    return TopLogprob(t.token_id, t.token, t.logprob)


def _prompt_logprobs(msg) -> PromptLogprobs | None:
    if not msg.HasField("prompt_logprobs"):
        return None
    p = msg.prompt_logprobs
    top = [[_top_logprob(t) for t in pos.top] for pos in p.top]
    return PromptLogprobs(list(p.token_ids), list(p.tokens), list(p.logprobs), top)


def _chunk(msg: generate_pb2.GenerateStreamResponse) -> CompletionChunk:
    last = msg.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    return CompletionChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH.get(msg.finish_reason) if last else None,
        stop_reason=msg.stop_reason,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.cached_tokens, msg.usage.completion_tokens)
        if last or msg.HasField("usage")  # stream_usage: on every chunk
        else None,
        ttft_ms=msg.timing.ttft_ms if msg.HasField("timing") and msg.timing.ttft_ms else None,
        reasoning_text=msg.reasoning_text,
        logprobs=_logprobs(msg),
        prompt_logprobs=_prompt_logprobs(msg),
        tool_calls=tool_call_deltas(msg),
        index=msg.index,
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
        reasoning_text=msg.reasoning_text,
        logprobs=_logprobs(msg),
        prompt_logprobs=_prompt_logprobs(msg),
        tool_calls=tool_calls(msg),
        index=msg.index,
        choices=[_completion(c) for c in msg.choices],
    )


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _pem(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def _credentials(
    tls: bool, tls_ca: str | bytes | None, tls_cert: str | bytes | None, tls_key: str | bytes | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS argument is given, else None (plaintext)."""
    if not (tls or tls_ca or tls_cert):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    return grpc.ssl_channel_credentials(_pem(tls_ca), _pem(tls_key), _pem(tls_cert))


def _call_metadata(metadata: Sequence[tuple[str, str]], token: str | None) -> list[tuple[str, str]]:
    return [*metadata, *bearer_metadata(token)]


def _retry_policy(retry: RetryPolicy | bool) -> RetryPolicy:
    """True: the default policy; False: no retries; a RetryPolicy as given."""
    if isinstance(retry, RetryPolicy):
        return retry
    return RetryPolicy() if retry else RetryPolicy(max_attempts=1)


class _ClientBase:
    """The constructor `Client` and `AsyncClient` share; `_grpc` (`grpc` or `grpc.aio`) opens the channel with
    `_options`."""

    _grpc: Any
    _options: list[tuple[str, Any]]

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        retry: RetryPolicy | bool = True,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | bytes | None = None,
        tls_cert: str | bytes | None = None,
        tls_key: str | bytes | None = None,
    ):
        creds = _credentials(tls, tls_ca, tls_cert, tls_key)
        self._channel = (
            self._grpc.secure_channel(target, creds, options=self._options)
            if creds is not None
            else self._grpc.insecure_channel(target, options=self._options)
        )
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self.timeout = timeout
        self.metadata = _call_metadata(metadata, token)
        self.retry = _retry_policy(retry)
        self.retries = 0  # RESOURCE_EXHAUSTED retried so far (all calls)


class Client(_ClientBase):
    """Blocking client. `timeout` (seconds) is the default deadline of each call (retries included); `retry`: how
    RESOURCE_EXHAUSTED is retried (True: `RetryPolicy()`, False: never); `token`, `tls*`: see the module docstring."""

    _grpc = grpc
    _options = SYNC_CHANNEL_OPTIONS

    def _backoff(self, err: grpc.RpcError, attempt: int, waited: float, deadline: float | None) -> float:
        """Sleep before the next attempt and return the seconds slept; re-raise `err` when the policy gives up."""
        d = self.retry.delay(err, attempt, waited, deadline)
        if d is None:
            raise err
        self.retries += 1
        time.sleep(d)
        return d

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> Completion:
        request, deadline, waited = build_request(prompt, **kw), _deadline(timeout or self.timeout), 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                resp = self._stub.Generate(request, timeout=_left(deadline), metadata=[*self.metadata, *metadata])
                return _completion(resp)
            except grpc.RpcError as e:
                waited += self._backoff(e, attempt, waited, deadline)
        raise AssertionError("unreachable: the last attempt raises")

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> Iterator[CompletionChunk]:
        request, deadline, waited = build_request(prompt, **kw), _deadline(timeout or self.timeout), 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            call = self._stub.GenerateStream(request, timeout=_left(deadline), metadata=[*self.metadata, *metadata])
            yielded = False
            try:
                for msg in call:
                    yielded = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as e:
                if yielded:  # tokens reached the caller: a retry would repeat them
                    raise
                waited += self._backoff(e, attempt, waited, deadline)
            finally:
                call.cancel()  # no-op when finished; stops generation when the caller breaks out early

    @overload
    def chat(self, messages: Sequence[dict[str, Any]], *, stream: Literal[False] = False, **kw) -> Completion: ...

    @overload
    def chat(self, messages: Sequence[dict[str, Any]], *, stream: Literal[True], **kw) -> Iterator[CompletionChunk]: ...

    def chat(
        self, messages: Sequence[dict[str, Any]], *, stream: bool = False, **kw
    ) -> Completion | Iterator[CompletionChunk]:
        """The assistant's next turn after `messages` ([{"role", "content"}], rendered with the model's chat
        template): a Completion, or its chunks with `stream=True`. Takes `generate`'s keywords; max_tokens unset
        means until EOS or the end of the context."""
        return self.stream(messages=messages, **kw) if stream else self.generate(messages=messages, **kw)

    def list_models(self, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()) -> list[str]:
        """The names of the models the router serves (what `model=` may name)."""
        resp = self._stub.ListModels(
            generate_pb2.ListModelsRequest(), timeout=timeout or self.timeout, metadata=[*self.metadata, *metadata]
        )
        return [m.name for m in resp.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """asyncio client with the same methods as `Client`."""

    _grpc = grpc.aio
    _options = CHANNEL_OPTIONS

    async def _backoff(self, err: grpc.RpcError, attempt: int, waited: float, deadline: float | None) -> float:
        d = self.retry.delay(err, attempt, waited, deadline)
        if d is None:
            raise err
        self.retries += 1
        await asyncio.sleep(d)
        return d

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> Completion:
        request, deadline, waited = build_request(prompt, **kw), _deadline(timeout or self.timeout), 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                resp = await self._stub.Generate(request, timeout=_left(deadline), metadata=[*self.metadata, *metadata])
                return _completion(resp)
            except grpc.RpcError as e:
                waited += await self._backoff(e, attempt, waited, deadline)
        raise AssertionError("unreachable: the last attempt raises")

    async def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), **kw
    ) -> AsyncGenerator[CompletionChunk, None]:
        request, deadline, waited = build_request(prompt, **kw), _deadline(timeout or self.timeout), 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            call = self._stub.GenerateStream(request, timeout=_left(deadline), metadata=[*self.metadata, *metadata])
            yielded = False
            try:
                async for msg in call:
                    yielded = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as e:
                if yielded:
                    raise
                waited += await self._backoff(e, attempt, waited, deadline)
            finally:
                call.cancel()

    def chat(self, messages: Sequence[dict[str, Any]], *, stream: bool = False, **kw):
        """As `Client.chat`: `await client.chat(messages)`, or `async for c in client.chat(messages, stream=True)`."""
        return self.stream(messages=messages, **kw) if stream else self.generate(messages=messages, **kw)

    async def list_models(self, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()) -> list[str]:
        """The names of the models the router serves (what `model=` may name)."""
        resp = await self._stub.ListModels(
            generate_pb2.ListModelsRequest(), timeout=timeout or self.timeout, metadata=[*self.metadata, *metadata]
        )
        return [m.name for m in resp.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
