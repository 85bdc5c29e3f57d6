"""OpenAI request bodies → SDK call arguments, and SDK results → OpenAI response objects.

Supported: `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or up to 4),
`stream`, `stream_options.include_usage`, `n=1`, `max_reasoning_tokens` (an extension), `logprobs` /
`top_logprobs` (chat) and `logprobs: N` + `echo` (completions, `gateway.logprobs`). Unset parameters keep the
pdserve defaults, which are OpenAI's and the SDK's / CLI's: max_tokens 16 for /v1/completions and "until EOS or
the context ends" for /v1/chat/completions (the router applies both), temperature and top_p the model's (its
generation_config.json, filled in by the router), else 1.0. A reasoning
model's thinking comes back as `reasoning_content` (the message / delta field DeepSeek's API uses). Parameters
that would change the output in ways pdserve cannot honour are rejected with 400, never silently ignored.
Ranges are OpenAI's (temperature 0..2, top_p 0..1, penalties -2..2, seed int64), cut to what the gRPC API carries
(int32 counts and token ids); the router's own checks (e.g. top_p > 0, the context length) come back as 400 too.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.client import Completion, Usage
from pdserve.router.gateway import fields
from pdserve.router.gateway.errors import APIError
from pdserve.router.gateway.fields import INT32_MAX

MAX_STOP = 4
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}  # developer: OpenAI's newer name for system
# parameters accepted only at their no-op value: name -> (that value, OpenAI's range)
NEUTRAL = {"n": (1, 1, 128), "best_of": (1, 1, 20), "presence_penalty": (0, -2, 2), "frequency_penalty": (0, -2, 2)}
UNSUPPORTED = ("logit_bias", "tools", "functions", "tool_choice", "function_call", "response_format", "suffix")


def sampling_args(body: dict) -> dict:
    """The SDK keyword arguments (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`) of an OpenAI body."""
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
    return dict(
        max_tokens=max_tokens,
        temperature=fields.number(body, "temperature", 0, 2),
        top_p=fields.number(body, "top_p", 0, 1),
        seed=fields.seed(body),
        stop=stop or None,
        max_reasoning_tokens=fields.integer(body, "max_reasoning_tokens", 0, INT32_MAX),  # pdserve extension
    )


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = fields.boolean(body, "stream") or False
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
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


def chat_messages(body: dict) -> list[dict[str, str]]:
    """`messages=` for the SDK: role + text content; the router validates roles against its template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
    return out


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion_json(
    rid: str, model: str, out: Completion, chat: bool, echo_text: str = "", logprobs: dict | None = None
) -> dict:
    """A whole `chat.completion` or `text_completion` object (`echo_text`: the prompt, completions with echo)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        if out.reasoning_text:
            choice["message"]["reasoning_content"] = out.reasoning_text
    else:
        choice["text"] = echo_text + out.text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_json(out.usage),
    }


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
) -> dict:
    """One streamed `chat.completion.chunk` / `text_completion` event with a single choice."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


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
