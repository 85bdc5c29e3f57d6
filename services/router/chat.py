"""Chat messages → prompt token ids, rendered with the model's own chat template (the tokenizer's, through
transformers' `apply_chat_template(..., add_generation_prompt=True)`), so the completion is the assistant's turn.
With tools (`pdserve.router.tools`), the template renders them too (`tools=`), and tool turns carry their calls
(`tool_calls`) and the call they answer (`tool_call_id`).

Bad input raises `pdserve.errors.InvalidRequest` (INVALID_ARGUMENT): an unknown role, too many messages or bytes,
an empty conversation, or a model whose tokenizer has no chat template.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.errors import InvalidRequest
from pdserve.router.tools.formats import template_text
from pdserve.router.tools.render import history_calls, inline_tool_calls, renders_tools, with_tools_in_system

ROLES = ("system", "user", "assistant", "tool")


class Message(Protocol):
    role: str
    content: str


@dataclass(frozen=True)
class ChatLimits:
    max_messages: int = 1024  # turns in one request
    max_bytes: int = 4 * 1024 * 1024  # UTF-8 bytes of all contents together (tool calls' names and arguments too)


def check_messages(messages: Iterable[Message], limits: ChatLimits = ChatLimits()) -> list[dict[str, Any]]:
    """Validate roles and limits; returns the messages as the dicts `apply_chat_template` takes."""
    out: list[dict[str, Any]] = []
    total = 0
    for i, m in enumerate(messages):
        if len(out) >= limits.max_messages:
            raise InvalidRequest(f"too many messages: at most {limits.max_messages}")
        if m.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {m.role!r}")
        calls = getattr(m, "tool_calls", ())
        call_id = getattr(m, "tool_call_id", "")
        total += len(m.content.encode()) + len(call_id.encode())
        total += sum(len(c.name.encode()) + len(c.arguments.encode()) + len(c.id.encode()) for c in calls)
        if total > limits.max_bytes:
            raise InvalidRequest(f"messages are too large: at most {limits.max_bytes} bytes of content")
        if calls and m.role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls: only an assistant turn has tool calls")
        if call_id and m.role != "tool":
            raise InvalidRequest(f"messages[{i}].tool_call_id: only a tool turn answers a call")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if calls:
            message["tool_calls"] = history_calls(calls, i)
        if call_id:
            message["tool_call_id"] = call_id
        out.append(message)
    if not out:
        raise InvalidRequest("messages is empty")
    return out


def render_chat(
    tokenizer, messages: Iterable[Message], limits: ChatLimits = ChatLimits(), tools: list[dict] | None = None
) -> str:
    """The prompt text of `messages` under the tokenizer's chat template, ending where the assistant speaks; `tools`
    (OpenAI's `tools` entries) rendered by the template, or into the system turn when the template ignores them."""
    conversation = check_messages(messages, limits)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; send prompt or token_ids instead of messages")
    from jinja2 import TemplateError

    extra: dict[str, Any] = {}
    if renders_tools(template_text(tokenizer)):
        if tools:
            extra["tools"] = tools
    else:  # a template without tool support: the tools and past calls written as text, Hermes style
        conversation = inline_tool_calls(conversation)
        if tools:
            conversation = with_tools_in_system(conversation, tools)
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **extra)
    except TemplateError as e:  # the template itself rejects the conversation (raise_exception on role order)
        raise InvalidRequest(f"the model's chat template rejected the messages: {e}") from e


def chat_prompt_ids(
    tokenizer, messages: Iterable[Message], limits: ChatLimits = ChatLimits(), tools: list[dict] | None = None
) -> list[int]:
    """Token ids of the rendered conversation. The template writes its own special tokens (BOS included where the
    model wants one), so tokenizing adds none, as `apply_chat_template(tokenize=True)` does."""
    text = render_chat(tokenizer, messages, limits, tools)
    return list(tokenizer(text, add_special_tokens=False).input_ids)
