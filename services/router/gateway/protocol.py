"""OpenAI request bodies → SDK call arguments, and SDK results → OpenAI response objects.

Supported: `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or up to 4),
`stream`, `stream_options.include_usage`, `n` (1..16 choices; chat and completions) and `best_of` (completions,
n..16; not streamed), `presence_penalty`, `frequency_penalty`, `logit_bias`,
`response_format` (text, json_object, json_schema), `user` (an identifier: no effect on the output),
`max_reasoning_tokens` (an extension), `logprobs` / `top_logprobs` (chat) and `logprobs: N` + `echo` (completions,
`gateway.logprobs`), `tools` / `tool_choice` / `parallel_tool_calls` and tool turns in `messages` (chat,
`gateway.tools`); and the fields vLLM-style clients send: `top_k` (-1 = off), `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
and `stream_options.continuous_usage_stats` (usage on every chunk). Any other field is a 400 naming it.
Unset parameters keep the pdserve defaults, which are OpenAI's and the SDK's / CLI's: max_tokens 16 for
/v1/completions and "until EOS or the context ends" for /v1/chat/completions (the router applies both), temperature
and top_p the model's (its generation_config.json, filled in by the router), else 1.0. A reasoning model's thinking
comes back as `reasoning_content` (the message / delta field DeepSeek's API uses). Parameters that would change the
output in ways pdserve cannot honour are rejected with 400, never silently ignored. Ranges are OpenAI's (temperature
0..2, top_p 0..1, penalties -2..2, seed int64), cut to what the gRPC API carries (int32 counts and token ids); the
router's own checks (e.g. top_p > 0, the context length) come back as 400 too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdserve.client import Completion, ToolCallDelta, Usage
from pdserve.engine.request_limits import MAX_LOGIT_BIAS, MAX_N, MAX_REPETITION_PENALTY, MAX_STOP_TOKEN_IDS
from pdserve.router.gateway import fields, tools
from pdserve.router.gateway.errors import APIError
from pdserve.router.gateway.fields import INT32_MAX

MAX_STOP = 4
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}  # developer: OpenAI's newer name for system
# parameters accepted only at their no-op value: name -> (that value, OpenAI's range)
NEUTRAL = {"best_of": (1, 1, 20)}  # chat only (completions take best_of)
UNSUPPORTED = ("functions", "function_call", "suffix")  # the legacy function calling: use tools
# every field a body may have; any other is a 400 naming it (OpenAI's "Unrecognized request argument")
COMMON_FIELDS = {
    "model", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format", "n",
    *NEUTRAL, *UNSUPPORTED,
    # pdserve and vLLM extensions
    "max_reasoning_tokens", "top_k", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
}  # fmt: skip
CHAT_FIELDS = {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = {"prompt", "echo"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def check_fields(body: dict, chat: bool) -> None:
    """A 400 naming the first field this endpoint does not know (never silently ignored)."""
    known = COMMON_FIELDS | (CHAT_FIELDS if chat else COMPLETION_FIELDS)
    for name in body:
        if name not in known:
            message = f"Unrecognized request argument supplied: {fields.short(name)}"
            raise APIError(400, message, param=str(name)[:60], code="unknown_parameter")


def sampling_args(body: dict, chat: bool) -> dict:
    """The SDK keyword arguments of an OpenAI body's sampling fields (`check_fields` first: every other field is
    refused)."""
    check_fields(body, chat)
    if chat:
        for name, (neutral, lo, hi) in NEUTRAL.items():
            fields.neutral_only(body, name, neutral, lo, hi)
    for name in UNSUPPORTED:
        if body.get(name):
            raise APIError(400, f"'{name}' is not supported", param=name, code="unsupported_parameter")
    max_tokens = fields.integer(body, "max_completion_tokens", 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = fields.integer(body, "max_tokens", 1, INT32_MAX)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    if stop is not None and len(stop) > MAX_STOP:
        raise APIError(400, f"'stop' takes at most {MAX_STOP} strings", param="stop")
    top_k = fields.integer(body, "top_k", -1, INT32_MAX)  # vLLM's -1 is off, as 0
    repetition_penalty = fields.number(body, "repetition_penalty", 0, MAX_REPETITION_PENALTY)
    if repetition_penalty == 0:
        raise APIError(400, "'repetition_penalty' must be > 0", param="repetition_penalty", code="invalid_value")
    min_tokens = fields.integer(body, "min_tokens", 0, INT32_MAX)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        message = f"'min_tokens' {min_tokens} exceeds max_tokens {max_tokens}"
        raise APIError(400, message, param="min_tokens", code="invalid_value")
    args = dict(
        max_tokens=max_tokens,
        temperature=fields.number(body, "temperature", 0, 2),
        top_p=fields.number(body, "top_p", 0, 1),
        top_k=None if top_k is None else max(top_k, 0),
        seed=fields.seed(body),
        stop=stop or None,
        stop_token_ids=fields.token_id_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        ignore_eos=bool(fields.boolean(body, "ignore_eos")),
        max_reasoning_tokens=fields.integer(body, "max_reasoning_tokens", 0, INT32_MAX),  # pdserve extension
        presence_penalty=fields.number(body, "presence_penalty", -2, 2),
        frequency_penalty=fields.number(body, "frequency_penalty", -2, 2),
        repetition_penalty=repetition_penalty,
        logit_bias=fields.token_bias(body, limit=MAX_LOGIT_BIAS),
        min_tokens=min_tokens,
        **structured_args(body),
        **choice_args(body, chat),
    )
    if continuous_usage(body):
        args["stream_usage"] = True
    return args


def choice_args(body: dict, chat: bool) -> dict:
    """`n` (choices of the prompt, 1..MAX_N) and, completions, `best_of` (candidates, n..MAX_N; the router refuses
    it on a stream, as OpenAI)."""
    n = fields.integer(body, "n", 1, MAX_N)
    args: dict[str, int] = {} if n is None else {"n": n}
    best_of = None if chat else fields.integer(body, "best_of", 1, MAX_N)
    if best_of is not None:
        if best_of < (n or 1):
            raise APIError(400, f"'best_of' {best_of} must be at least n ({n or 1})", param="best_of")
        args["best_of"] = best_of
    return args


def structured_args(body: dict) -> dict:
    """The SDK's structured-output argument from `response_format` (OpenAI: text, json_object, json_schema) or
    vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (at most one of them all)."""
    rf = body.get("response_format")
    plain = isinstance(rf, dict) and rf.get("type") == "text"  # no constraint: combines with the others
    given = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    if plain and len(given) > 1:
        _response_format(rf)  # still checked
        given.remove("response_format")
    if len(given) > 1:
        raise APIError(400, f"'{given[1]}' cannot be combined with '{given[0]}'", param=given[1])
    if not given:
        return {}
    name = given[0]
    v = body[name]
    if name == "response_format":
        return _response_format(v)
    kind = GUIDED[name]
    if kind == "json_schema" and isinstance(v, (dict, str)):
        return {"json_schema": v}
    if kind == "choice" and isinstance(v, list) and v and all(isinstance(c, str) and c for c in v):
        return {"choice": v}
    if kind in ("regex", "grammar") and isinstance(v, str) and v:
        return {kind: v}
    want = {"json_schema": "a JSON schema", "choice": "a list of non-empty strings"}.get(kind, "a non-empty string")
    raise APIError(400, f"'{name}' must be {want}", param=name, code="invalid_type")


def _response_format(v: object) -> dict:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        message = "'response_format' must be an object with 'type' text, json_object or json_schema"
        raise APIError(400, message, param="response_format", code="invalid_value")
    if v["type"] == "text":
        return {}
    if v["type"] == "json_object":
        return {"json_object": True}
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        message = "'response_format.json_schema' must be an object with a 'name' and a 'schema'"
        raise APIError(400, message, param="response_format", code="invalid_value")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return {"json_object": True}
    if not isinstance(schema, dict):
        message = "'response_format.json_schema.schema' must be a JSON Schema object"
        raise APIError(400, message, param="response_format", code="invalid_type")
    return {"json_schema": schema}  # strict or not, the output follows the schema


def continuous_usage(body: dict) -> bool:
    """`stream_options.continuous_usage_stats` (vLLM's): usage on every streamed chunk."""
    options = body.get("stream_options")
    if not isinstance(options, dict) or options.get("continuous_usage_stats") is None:
        return False
    v = options["continuous_usage_stats"]
    if not isinstance(v, bool):
        message = "'stream_options.continuous_usage_stats' must be a boolean"
        raise APIError(400, message, param="stream_options", code="invalid_type")
    return v


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = fields.boolean(body, "stream") or False
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        name = sorted(map(str, unknown))[0]
        message = f"Unrecognized request argument supplied: stream_options.{fields.short(name)}"
        raise APIError(400, message, param="stream_options", code="unknown_parameter")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return stream, bool(include_usage) and stream


def completion_input(body: dict) -> dict:
    """`prompt=` or `token_ids=` from a /v1/completions `prompt` (a string, token ids, or a batch of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"token_ids": fields.token_ids(prompt)}
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """`messages=` for the SDK: role + text content, an assistant turn's `tool_calls`, a tool turn's `tool_call_id`;
    the router validates roles against its template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict[str, Any] = {"role": role, "content": _content_text(m.get("content"), i)}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = tools.history_calls(m["tool_calls"], i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise APIError(400, f"messages[{i}]: a tool message needs a 'tool_call_id' string", param="messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion_json(
    rid: str,
    model: str,
    out: Completion,
    chat: bool,
    echo_text: str = "",
    logprobs: Callable[[Completion], dict | None] = lambda _: None,
) -> dict:
    """A whole `chat.completion` or `text_completion` object (`echo_text`: the prompt, completions with echo;
    `logprobs(choice)`: a choice's logprobs object). n > 1: one choice per `out.choices`, usage the request's."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice_json(c, chat, echo_text, logprobs(c)) for c in (out.choices or [out])],
        "usage": usage_json(out.usage),
    }


def _choice_json(out: Completion, chat: bool, echo_text: str, logprobs: dict | None) -> dict:
    choice: dict[str, Any] = {"index": out.index, "finish_reason": out.finish_reason, "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        if out.tool_calls:  # OpenAI: content null when the turn is only calls
            choice["message"].update(content=out.text or None, tool_calls=tools.calls_json(out.tool_calls))
        if out.reasoning_text:
            choice["message"]["reasoning_content"] = out.reasoning_text
    else:
        choice["text"] = echo_text + out.text
    return choice


def chunk_json(
    rid: str,
    model: str,
    created: int,
    chat: bool,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    logprobs: dict | None = None,
    reasoning: str = "",
    usage: Usage | None = None,
    tool_calls: list[ToolCallDelta] | None = None,
    index: int = 0,
) -> dict:
    """One streamed `chat.completion.chunk` / `text_completion` event with a single choice, number `index` (`usage`:
    the running usage, with `stream_options.continuous_usage_stats`; `tool_calls`: pieces of tool calls, chat)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None and (text or not tool_calls):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tools.deltas_json(tool_calls)
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        out["usage"] = usage_json(usage)
    return out


def usage_chunk_json(rid: str, model: str, created: int, chat: bool, usage: Usage) -> dict:
    """The last event of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }
