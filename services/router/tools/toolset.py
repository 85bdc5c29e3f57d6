"""A request's tools and tool_choice (GenerateRequest.tools / tool_choice / parallel_tool_calls), validated: names,
sizes, parameter schemas, a named choice among the tools. Bad input raises `InvalidRequest` naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequest
from pdserve.v1 import generate_pb2

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT: dict[str, Any] = {"type": "object"}
AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema object

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI `tools[]` entry chat templates take (`apply_chat_template(tools=...)`)."""
        function: dict[str, Any] = {"name": self.name}  # OpenAI's key order: templates `tojson` it as it is
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSet:
    """`mode`: auto, none, required or named (`function` then names the one tool called)."""

    tools: tuple[Tool, ...]
    mode: str
    function: str = ""
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        """The grammar engine makes the output calls (required, a named function)."""
        return self.mode in (REQUIRED, NAMED)

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (None: none, as with tool_choice none)."""
        if self.mode == NONE or not self.tools:
            return None
        return [t.as_openai() for t in self.tools]

    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools an enforced output may call."""
        return tuple(t for t in self.tools if self.mode != NAMED or t.name == self.function)


def _parameters(text: str, i: int) -> dict[str, Any]:
    if not text:
        return dict(ANY_OBJECT)
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"tools[{i}].parameters is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"tools[{i}].parameters must be a JSON Schema object")
    return schema


def tool_set(request: generate_pb2.GenerateRequest, max_bytes: int) -> ToolSet | None:
    """The request's tools and choice, None when it has neither; `max_bytes`: the tools' text together (names,
    descriptions, parameters) at most this many UTF-8 bytes."""
    has_choice = request.HasField("tool_choice") and request.tool_choice.WhichOneof("choice") is not None
    if not request.tools and not has_choice:
        if request.HasField("parallel_tool_calls"):
            raise InvalidRequest("parallel_tool_calls is set but tools is empty")
        return None
    if not request.messages:
        raise InvalidRequest("tools and tool_choice need messages (a chat), not prompt or token_ids")
    if len(request.tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(request.tools)} tools; at most {MAX_TOOLS}")
    text = [f"{t.name}{t.description}{t.parameters}" for t in request.tools]
    if sum(map(len, text)) > max_bytes or sum(len(x.encode()) for x in text) > max_bytes:
        raise InvalidRequest(f"tools are larger than max_prompt_bytes={max_bytes} bytes")
    tools, seen = [], set()
    for i, t in enumerate(request.tools):
        if not TOOL_NAME.fullmatch(t.name):
            raise InvalidRequest(f"tools[{i}].name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {t.name[:80]!r}")
        if t.name in seen:
            raise InvalidRequest(f"tools[{i}].name {t.name!r} is given twice")
        seen.add(t.name)
        tools.append(Tool(t.name, t.description, _parameters(t.parameters, i)))
    mode, function = _choice(request.tool_choice if has_choice else None, seen)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolSet(tuple(tools), mode, function, parallel)


def _choice(choice: generate_pb2.ToolChoice | None, names: set[str]) -> tuple[str, str]:
    if choice is None:
        return (AUTO if names else NONE), ""
    if choice.WhichOneof("choice") == "function":
        if choice.function not in names:
            known = ", ".join(sorted(names)) or "none"
            raise InvalidRequest(
                f"tool_choice names the function {choice.function[:80]!r}, which is not among tools ({known[:300]})"
            )
        return NAMED, choice.function
    mode = {
        generate_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: AUTO,
        generate_pb2.TOOL_CHOICE_MODE_AUTO: AUTO,
        generate_pb2.TOOL_CHOICE_MODE_NONE: NONE,
        generate_pb2.TOOL_CHOICE_MODE_REQUIRED: REQUIRED,
    }.get(choice.mode)
    if mode is None:
        raise InvalidRequest(f"tool_choice.mode {choice.mode} is not a ToolChoiceMode")
    if mode == REQUIRED and not names:
        raise InvalidRequest("tool_choice required needs tools")
    if mode == AUTO and not names:
        return NONE, ""
    return mode, ""
