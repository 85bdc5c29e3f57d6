"""Tool calling in the Python SDK: OpenAI-shaped tools, tool_choice and tool turns → the Generation API's messages,
and its calls back as `ToolCall` / `ToolCallDelta`.

    out = client.chat(messages, tools=[{"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", ...}}}], tool_choice="required")
    out.tool_calls  # [ToolCall(id="call_...", name="get_weather", arguments='{"city": "Paris"}')]
    messages += [{"role": "assistant", "content": out.text, "tool_calls": out.tool_calls},
                 {"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "21 C"}]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.v1 import generate_pb2

_MODES = {
    "auto": generate_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": generate_pb2.TOOL_CHOICE_MODE_NONE,
    "required": generate_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


@dataclass
class ToolCall:
    """A call the model made; `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A streamed piece of call `index`: the first has its id and name, the next ones pieces of its arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def _call_proto(call: Any) -> generate_pb2.ToolCall:
    """A history call: a ToolCall, or OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}."""
    if isinstance(call, ToolCall):
        return generate_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
    function = call.get("function", call)
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return generate_pb2.ToolCall(id=call.get("id", ""), name=function["name"], arguments=arguments)


def chat_message(m: Mapping[str, Any]) -> generate_pb2.ChatMessage:
    """One turn: {"role", "content"} and, for an assistant turn, its `tool_calls`; for a tool turn, `tool_call_id`."""
    msg = generate_pb2.ChatMessage(role=m["role"], content=m.get("content") or "")
    msg.tool_calls.extend(_call_proto(c) for c in m.get("tool_calls") or ())
    msg.tool_call_id = m.get("tool_call_id") or ""
    return msg


def tool_proto(tool: Mapping[str, Any]) -> generate_pb2.Tool:
    """OpenAI's {"type": "function", "function": {"name", "description", "parameters"}} (or the inner object)."""
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    text = parameters if isinstance(parameters, str) else json.dumps(parameters) if parameters is not None else ""
    return generate_pb2.Tool(name=function["name"], description=function.get("description") or "", parameters=text)


def tool_choice_proto(choice: str | Mapping[str, Any]) -> generate_pb2.ToolChoice:
    """One of auto, none, required, or a function: {"type": "function", "function": {"name": ...}}."""
    if isinstance(choice, str):
        if choice not in _MODES:
            raise ValueError(f"tool_choice must be auto, none, required or a function, not {choice!r}")
        return generate_pb2.ToolChoice(mode=_MODES[choice])
    return generate_pb2.ToolChoice(function=choice.get("function", choice)["name"])


def add_tools(
    req: generate_pb2.GenerateRequest,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> None:
    req.tools.extend(tool_proto(t) for t in tools or ())
    if tool_choice is not None:
        req.tool_choice.CopyFrom(tool_choice_proto(tool_choice))
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls


def tool_calls(msg: generate_pb2.GenerateResponse) -> list[ToolCall]:
    return [ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls]


def tool_call_deltas(msg: generate_pb2.GenerateStreamResponse) -> list[ToolCallDelta]:
    return [ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in msg.tool_calls]
