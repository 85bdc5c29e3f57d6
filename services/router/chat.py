"""Chat messages → prompt token ids, rendered with the model's own chat template (the tokenizer's, through
transformers' `apply_chat_template(..., add_generation_prompt=True)`), so the completion is the assistant's turn.

Bad input raises `pdserve.errors.InvalidRequest` (INVALID_ARGUMENT): an unknown role, too many messages or bytes,
an empty conversation, or a model whose tokenizer has no chat template.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from pdserve.errors import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")


class Message(Protocol):
    role: str
    content: str


@dataclass(frozen=True)
class ChatLimits:
    max_messages: int = 1024  # turns in one request
    max_bytes: int = 4 * 1024 * 1024  # UTF-8 bytes of all contents together


def check_messages(messages: Iterable[Message], limits: ChatLimits = ChatLimits()) -> list[dict[str, str]]:
    """Validate roles and limits; returns the messages as the dicts `apply_chat_template` takes."""
    out: list[dict[str, str]] = []
    total = 0
    for i, m in enumerate(messages):
        if len(out) >= limits.max_messages:
            raise InvalidRequest(f"too many messages: at most {limits.max_messages}")
        if m.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {m.role!r}")
        total += len(m.content.encode())
        if total > limits.max_bytes:
            raise InvalidRequest(f"messages are too large: at most {limits.max_bytes} bytes of content")
        out.append({"role": m.role, "content": m.content})
    if not out:
        raise InvalidRequest("messages is empty")
    return out


def render_chat(tokenizer, messages: Iterable[Message], limits: ChatLimits = ChatLimits()) -> str:
    """The prompt text of `messages` under the tokenizer's chat template, ending where the assistant speaks."""
    conversation = check_messages(messages, limits)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; send prompt or token_ids instead of messages")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except TemplateError as e:  # the template itself rejects the conversation (raise_exception on role order)
        raise InvalidRequest(f"the model's chat template rejected the messages: {e}") from e


def chat_prompt_ids(tokenizer, messages: Iterable[Message], limits: ChatLimits = ChatLimits()) -> list[int]:
    """Token ids of the rendered conversation. The template writes its own special tokens (BOS included where the
    model wants one), so tokenizing adds none, as `apply_chat_template(tokenize=True)` does."""
    text = render_chat(tokenizer, messages, limits)
    return list(tokenizer(text, add_special_tokens=False).input_ids)
