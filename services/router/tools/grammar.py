"""tool_choice required / a named function, enforced: an xgrammar structural tag (StructuredOutput.structural_tag)
that admits only calls in the model's format, each call's arguments valid against its tool's parameters, so the
output always parses. Built as plain JSON here (the router holds no grammar engine); the engine compiles it.

JSON whitespace is capped (MAX_WHITESPACE a run) and so are the calls (MAX_CALLS): a model cannot pad a call with
endless blanks nor call forever, and bounded schemas always end."""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.tools.formats import ToolFormat
from pdserve.router.tools.toolset import NAMED, ToolSet
from pdserve.v1 import generate_pb2

MAX_WHITESPACE = 1  # consecutive whitespace characters inside a call's JSON (compact JSON with single spaces fits)
MAX_CALLS = 16  # calls in one enforced response (required with parallel_tool_calls): the output stays bounded


def call_tags(fmt: ToolFormat, tools: ToolSet) -> list[dict[str, Any]]:
    """One tag per callable tool: the format's call opening with the tool's name, its arguments, the closing."""
    return [
        {
            "type": "tag",
            "begin": fmt.call_prefix(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters, "max_whitespace_cnt": MAX_WHITESPACE},
            "end": fmt.call_suffix(),
        }
        for tool in tools.callable_tools()
    ]


def call_structural_tag(fmt: ToolFormat, tools: ToolSet) -> str:
    """The structural tag (JSON text) of an enforced tool choice: one call (a named function, or required without
    parallel_tool_calls) or 1 to MAX_CALLS, and nothing else."""
    call: dict[str, Any] = {"type": "or", "elements": call_tags(fmt, tools)}
    calls = call
    if tools.mode != NAMED and tools.parallel:
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": fmt.separator}, call]}
        calls = {
            "type": "sequence",
            "elements": [call, {"type": "repeat", "min": 0, "max": MAX_CALLS - 1, "content": more}],
        }
    if fmt.array:  # the calls are one JSON array after the marker
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": fmt.markers[0] + "["},
                calls,
                {"type": "const_string", "value": "]"},
            ],
        }
    return json.dumps({"type": "structural_tag", "format": calls}, ensure_ascii=False)


def call_constraint(fmt: ToolFormat, tools: ToolSet) -> generate_pb2.StructuredOutput | None:
    """The StructuredOutput that enforces `tools`' choice, None when nothing is enforced (auto, none)."""
    if not tools.enforced:
        return None
    return generate_pb2.StructuredOutput(structural_tag=call_structural_tag(fmt, tools))
