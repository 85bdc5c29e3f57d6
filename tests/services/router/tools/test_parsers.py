"""Tool calls parsed out of model output in the three formats (Hermes / Qwen2.5, Llama 3.x JSON, Mistral): calls,
the text around them, regions that are not calls given back as text, and a stream fed in any split parsing to
exactly what the whole output parses to."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.router.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from pdserve.router.tools.parsers import ToolCallParser, parse_calls

WEATHER = {"city": "Paris", "days": 3, "nested": {"s": 'a } ] " brace', "list": [1, {"k": None}]}}
WEATHER_TEXT = json.dumps(WEATHER)

CASES = [
    # (format, output, content, [(name, arguments)])
    (
        HERMES,
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "Let me look.\n",
        [("get_weather", WEATHER_TEXT), ("get_time", "{}")],
    ),
    (HERMES, "no call here, only <tool_ ... text", "no call here, only <tool_ ... text", []),
    (HERMES, "<tool_call>not json</tool_call> then", "<tool_call>not json</tool_call> then", []),
    (
        HERMES,
        '<tool_call>\n{"arguments": {"a": 1}, "name": "late_name"}\n</tool_call>',
        "",
        [("late_name", '{"a": 1}')],
    ),
    (HERMES, '<tool_call>\n{"name": "no_args"}\n</tool_call>', "", [("no_args", "{}")]),
    (
        HERMES,
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        [],
    ),
    (
        LLAMA3_JSON,
        f' {{"name": "get_weather", "parameters": {WEATHER_TEXT}}}; {{"name": "get_time", "parameters": {{}}}}',
        "",
        [("get_weather", WEATHER_TEXT), ("get_time", "{}")],
    ),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}', "", [("f", '{"x": 1}')]),
    (LLAMA3_JSON, '{"answer": 42} is JSON, not a call', '{"answer": 42} is JSON, not a call', []),
    (LLAMA3_JSON, 'Text first {"name": "f", "parameters": {}}', 'Text first {"name": "f", "parameters": {}}', []),
    (
        MISTRAL,
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}, '
        '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]',
        "",
        [("get_weather", WEATHER_TEXT), ("get_time", '{"tz": "UTC"}')],  # arguments as a JSON string: unwrapped
    ),
    (MISTRAL, '[{"name": "f", "arguments": {"x": [1]}}]', "", [("f", '{"x": [1]}')]),  # the marker token skipped
    (MISTRAL, "[1, 2] is a list", "[1, 2] is a list", []),
]


@pytest.mark.parametrize("fmt,output,content,calls", CASES, ids=lambda v: v.name if isinstance(v, ToolFormat) else "")
def test_whole_output(fmt, output, content, calls):
    got_content, got = parse_calls(fmt, output)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    for c in got:
        assert isinstance(json.loads(c.arguments), dict)
    assert len({c.id for c in got}) == len(got)
    if fmt is MISTRAL:
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got)


def _streamed(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    parser = ToolCallParser(fmt)
    content, calls, deltas = [], {}, []
    for piece in [*pieces, None]:
        text, ds = parser.feed(piece) if piece is not None else parser.finish()
        content.append(text)
        deltas += ds
        for d in ds:
            if d.id:
                assert d.index not in calls and d.index == len(calls)  # id and name first, in order
                calls[d.index] = [d.name, d.arguments]
            else:
                calls[d.index][1] += d.arguments
    return "".join(content), [tuple(v) for v in calls.values()], deltas


@pytest.mark.parametrize("fmt,output,content,calls", CASES, ids=lambda v: v.name if isinstance(v, ToolFormat) else "")
def test_any_split_streams_the_same(fmt, output, content, calls):
    rng = random.Random(len(output))
    splits = [[output], list(output)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(output)), k=min(len(output) - 1, rng.randint(1, 8))))
        splits.append([output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])])
    for pieces in splits:
        got_content, got_calls, _ = _streamed(fmt, pieces)
        assert (got_content, got_calls) == (content, calls), pieces


def test_arguments_stream_before_the_call_closes():
    """Per character: the name arrives as soon as its string closes, the arguments piece by piece after it."""
    output = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}\n</tool_call>'
    _, calls, deltas = _streamed(HERMES, list(output))
    assert calls == [("get_weather", WEATHER_TEXT)]
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > len(WEATHER_TEXT) // 2  # many argument pieces, not one at the end


def test_cut_off_call_is_a_partial_call():
    """An output cut inside a named call keeps the call (its arguments so far); one cut before a name is text."""
    content, calls = parse_calls(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1')]
    content, calls = parse_calls(HERMES, 'ok <tool_call>\n{"na')
    assert content == 'ok <tool_call>\n{"na' and calls == []
