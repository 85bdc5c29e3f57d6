"""Tool turns of a conversation as chat templates take them (OpenAI's shape): an assistant turn's `tool_calls`
(arguments as a mapping, which Llama's and Qwen's templates `tojson`), a tool turn's `tool_call_id`; and the
tools block for a template that does not render `tools` itself (written into the system turn, Hermes style)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.errors import InvalidRequest

MAX_CALLS_PER_MESSAGE = 128


def history_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's calls (proto ToolCall messages) in OpenAI's shape, arguments parsed when they are JSON."""
    out = []
    if len(calls) > MAX_CALLS_PER_MESSAGE:
        raise InvalidRequest(f"messages[{i}].tool_calls has {len(calls)} calls; at most {MAX_CALLS_PER_MESSAGE}")
    for j, call in enumerate(calls):
        if not call.name:
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}].name is empty")
        arguments: Any = call.arguments
        try:
            parsed = json.loads(call.arguments or "{}")
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        out.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
    return out


def renders_tools(template: str) -> bool:
    """Whether a chat template's source reads the `tools` variable."""
    return "tools" in template


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tools block a template without tool support gets in its system turn (Qwen2.5's wording)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tools_in_system(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`conversation` with the tools block appended to its system turn (one is added first when it has none)."""
    block = tools_system_text(tools)
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0])
        first["content"] = f"{first['content']}\n\n{block}" if first["content"] else block
        return [first, *conversation[1:]]
    return [{"role": "system", "content": block}, *conversation]


def calls_as_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls written as Hermes `<tool_call>` blocks (for a template that ignores tool_calls)."""
    blocks = []
    for call in calls:
        function = call["function"]
        body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)


def inline_tool_calls(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`conversation` with each assistant turn's `tool_calls` written into its content (`calls_as_text`)."""
    out = []
    for m in conversation:
        if m.get("tool_calls"):
            text = calls_as_text(m["tool_calls"])
            m = {"role": m["role"], "content": f"{m['content']}\n{text}" if m["content"] else text}
        out.append(m)
    return out
