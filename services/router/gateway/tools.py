"""OpenAI tool calling ↔ the SDK: `tools` / `tool_choice` / `parallel_tool_calls` of a chat body checked and
passed on (the router renders the tools with the model's chat template, enforces `required` and a named function
with the grammar engine, and parses the calls out of the output), tool turns of `messages`, and the calls back as
the message's `tool_calls` or streamed `tool_calls` deltas. A bad field is a 400 naming it."""

from __future__ import annotations

import re
from typing import Any

from pdserve.client import ToolCall, ToolCallDelta
from pdserve.router.gateway.errors import APIError
from pdserve.router.gateway.fields import short

MAX_TOOLS = 128  # the router's ceiling (pdserve.router.tools.toolset)
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
MODES = ("auto", "none", "required")


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _function(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", "tools", "invalid_type")
    for key in tool:
        if key not in ("type", "function"):
            raise _bad(f"Unrecognized request argument supplied: {where}.{short(key)}", "tools", "unknown_parameter")
    function = tool["function"]
    for key in function:
        if key not in FUNCTION_FIELDS:
            message = f"Unrecognized request argument supplied: {where}.function.{short(key)}"
            raise _bad(message, "tools", "unknown_parameter")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _bad(f"'{where}.function.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {short(name)}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"'{where}.function.description' must be a string", "tools", "invalid_type")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"'{where}.function.parameters' must be a JSON Schema object", "tools", "invalid_type")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):  # strict or not, an enforced call follows the schema
        raise _bad(f"'{where}.function.strict' must be a boolean", "tools", "invalid_type")
    return {"name": name, "description": description or "", "parameters": parameters}


def _choice(v: Any, names: list[str]) -> str | dict[str, Any]:
    if isinstance(v, str):
        if v not in MODES:
            raise _bad(f"'tool_choice' must be auto, none, required or a function, got {short(v)}", "tool_choice")
        if v == "required" and not names:
            raise _bad("'tool_choice' required needs 'tools'", "tool_choice")
        return v
    function = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        message = "'tool_choice' must be auto, none, required or {'type': 'function', 'function': {'name': ...}}"
        raise _bad(message, "tool_choice", "invalid_type")
    name = function["name"]
    if name not in names:
        known = ", ".join(names) or "no tools"
        message = f"'tool_choice' names the function {short(name)}, which is not among 'tools' ({short(known, 200)})"
        raise _bad(message, "tool_choice")
    return {"type": "function", "function": {"name": name}}


def tool_args(body: dict) -> dict[str, Any]:
    """The SDK's `tools` / `tool_choice` / `parallel_tool_calls` keywords of a chat body ({} when it has none)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    args: dict[str, Any] = {}
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools", "invalid_type")
        functions = [_function(t, i) for i, t in enumerate(tools)]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise _bad(f"'tools' names the function {dup!r} twice", "tools")
        if functions:
            args["tools"] = functions
    if choice is not None:
        args["tool_choice"] = _choice(choice, names)
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad(f"'parallel_tool_calls' must be a boolean, got {short(parallel)}", "parallel_tool_calls")
        if names:
            args["parallel_tool_calls"] = parallel
    return args


def history_calls(calls: Any, i: int) -> list[dict[str, str]]:
    """An assistant turn's `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}])."""
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls must be a list", "messages", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(call.get("id", ""), str)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments", ""), str)
        ):
            shape = "{'id', 'type': 'function', 'function': {'name', 'arguments'}}"
            message = f"messages[{i}].tool_calls[{j}] must be {shape}"
            raise _bad(message, "messages", "invalid_type")
        out.append({"id": call.get("id", ""), "name": function["name"], "arguments": function.get("arguments", "")})
    return out


def calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A message's `tool_calls`."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def deltas_json(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """A chunk's `delta.tool_calls`: a call's first piece with its id, type and name, the next ones its arguments."""
    out = []
    for d in deltas:
        if d.id:
            function = {"name": d.name, "arguments": d.arguments}
            out.append({"index": d.index, "id": d.id, "type": "function", "function": function})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out
