"""The router's relayed chunks with tool calls parsed out: each chunk's `text` becomes the text outside calls and
its `tool_calls` the call deltas (`parsers.ToolCallParser`); a turn that ended (EOS / a stop) after calls finishes
with FINISH_REASON_TOOL_CALLS. One `ToolCallStream` per request, kept across failover attempts (its parse state
follows what the caller has seen). `merge_calls` joins a stream's deltas into whole calls (GenerateResponse)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pdserve.router.tools.formats import ToolFormat
from pdserve.router.tools.parsers import CallDelta, ToolCallParser
from pdserve.v1 import generate_pb2


class ToolCallStream:
    def __init__(self, fmt: ToolFormat):
        self.parser = ToolCallParser(fmt)

    def shape(
        self, chunks: Iterable[generate_pb2.GenerateStreamResponse]
    ) -> Iterator[generate_pb2.GenerateStreamResponse]:
        for out in chunks:
            content, deltas = self.parser.feed(out.text)
            if out.finish_reason:
                rest, more = self.parser.finish()
                content, deltas = content + rest, deltas + more
                if self.parser.calls and out.finish_reason == generate_pb2.FINISH_REASON_STOP:
                    out.finish_reason = generate_pb2.FINISH_REASON_TOOL_CALLS
            out.text = content
            out.tool_calls.extend(_delta_proto(d) for d in deltas)
            yield out


def _delta_proto(d: CallDelta) -> generate_pb2.ToolCallDelta:
    return generate_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)


def merge_calls(deltas: Iterable[generate_pb2.ToolCallDelta]) -> list[generate_pb2.ToolCall]:
    """Whole calls from their deltas, in index order (a call's first delta has its id and name)."""
    calls: dict[int, generate_pb2.ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = generate_pb2.ToolCall(id=d.id, name=d.name)
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]
