"""One request's tool calling, as the router's servicer uses it: the validated tools and choice (`toolset`), the
model's format (`formats`), what the chat template renders, the grammar an enforced choice adds to the sampling
(`grammar`), and the stream parser of its output (`stream`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequest
from pdserve.router.tools.formats import ToolFormat, choose_format
from pdserve.router.tools.grammar import call_constraint
from pdserve.router.tools.stream import ToolCallStream
from pdserve.router.tools.toolset import NONE, ToolSet, tool_set
from pdserve.v1 import generate_pb2


@dataclass(frozen=True)
class ToolCalling:
    tools: ToolSet
    fmt: ToolFormat

    @classmethod
    def of(
        cls, request: generate_pb2.GenerateRequest, tokenizer: Any, parser: str, max_bytes: int
    ) -> ToolCalling | None:
        """The request's tool calling (None without tools); `parser`: the router's --tool-call-parser ("" auto);
        raises InvalidRequest for bad tools or choice."""
        tools = tool_set(request, max_bytes)
        if tools is None:
            return None
        return cls(tools, choose_format(tokenizer, parser))

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """`tools=` for the chat template (None with tool_choice none)."""
        return self.tools.rendered

    def constrain(self, sampling: generate_pb2.SamplingParams) -> None:
        """Add the grammar of an enforced choice (required, a named function) to `sampling`."""
        constraint = call_constraint(self.fmt, self.tools)
        if constraint is None:
            return
        if sampling.HasField("structured"):
            raise InvalidRequest("tool_choice required or a named function cannot be combined with structured output")
        sampling.structured.CopyFrom(constraint)

    def stream(self) -> ToolCallStream | None:
        """The parser of this request's output (None with tool_choice none: nothing is parsed)."""
        return None if self.tools.mode == NONE else ToolCallStream(self.fmt)
