"""A request's tools and tool_choice checked by the router (every bad one an InvalidRequest naming the field), the
format chosen for a model, and tool turns rendered for a template without tool support."""

from __future__ import annotations

import json

import pytest

from pdserve.client import build_request
from pdserve.errors import InvalidRequest
from pdserve.models.checkpoints import CHATML_TEMPLATE
from pdserve.router.chat import render_chat
from pdserve.router.tools.calling import ToolCalling
from pdserve.router.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, choose_format
from pdserve.router.tools.toolset import AUTO, NAMED, NONE, REQUIRED, tool_set
from pdserve.v1 import generate_pb2

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT = [{"role": "user", "content": "hi"}]


def _request(**kw) -> generate_pb2.GenerateRequest:
    return build_request(messages=kw.pop("messages", CHAT), **kw)


@pytest.mark.parametrize(
    "kw,mode",
    [
        ({"tools": [TOOL]}, AUTO),
        ({"tools": [TOOL], "tool_choice": "none"}, NONE),
        ({"tools": [TOOL], "tool_choice": "required"}, REQUIRED),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, NAMED),
        ({"tool_choice": "auto"}, NONE),  # auto without tools: nothing to call
    ],
)
def test_modes(kw, mode):
    tools = tool_set(_request(**kw), 1 << 20)
    assert tools is not None and tools.mode == mode
    assert tools.enforced == (mode in (REQUIRED, NAMED))
    assert (tools.rendered is None) == (mode == NONE)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"name": "bad name"}]}, "tools[0].name"),
        ({"tools": [TOOL, TOOL]}, "twice"),
        ({"tools": [{"name": "f", "parameters": "[1]"}]}, "tools[0].parameters"),
        ({"tools": [{"name": "f", "parameters": "{"}]}, "not valid JSON"),
        ({"tools": [TOOL] * 129}, "at most 128"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_refused(kw, words):
    with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
        tool_set(_request(**kw), 1 << 20)


def test_tools_count_against_the_size_limit_and_need_messages():
    big = {"name": "f", "description": "x" * 2000}
    with pytest.raises(InvalidRequest, match="max_prompt_bytes"):
        tool_set(_request(tools=[big]), 1000)
    req = build_request(prompt="hi", tools=[TOOL])
    with pytest.raises(InvalidRequest, match="need messages"):
        tool_set(req, 1 << 20)


def test_enforced_choice_does_not_combine_with_structured_output():
    calling = ToolCalling.of(_request(tools=[TOOL], tool_choice="required"), None, "hermes", 1 << 20)
    assert calling is not None
    sampling = generate_pb2.SamplingParams(structured=generate_pb2.StructuredOutput(regex="a"))
    with pytest.raises(InvalidRequest, match="structured output"):
        calling.constrain(sampling)
    sampling = generate_pb2.SamplingParams()
    calling.constrain(sampling)
    assert json.loads(sampling.structured.structural_tag)["type"] == "structural_tag"


class _Tok:
    def __init__(self, template: str, path: str = ""):
        self.chat_template, self.name_or_path = template, path


def test_format_from_template_model_type_or_flag(tmp_path):
    assert choose_format(_Tok("... <tool_call> ...")) is HERMES
    assert choose_format(_Tok("... [TOOL_CALLS] ...")) is MISTRAL
    assert choose_format(_Tok("... <|python_tag|> ...")) is LLAMA3_JSON
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert choose_format(_Tok(CHATML_TEMPLATE, str(tmp_path))) is MISTRAL
    assert choose_format(_Tok(CHATML_TEMPLATE)) is HERMES
    assert choose_format(_Tok("<tool_call>"), "llama3_json") is LLAMA3_JSON
    with pytest.raises(ValueError, match="hermes"):
        choose_format(_Tok(""), "nope")


def test_template_without_tool_support_gets_tools_and_calls_as_text(tmp_path):
    """ChatML knows no tools: they go into the system turn, past calls into the assistant turn, Hermes style."""
    from transformers import AutoTokenizer

    from pdserve.models.checkpoints import build_tokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
    ]
    req = _request(messages=history, tools=[TOOL])
    text = render_chat(tok, req.messages, tools=ToolCalling.of(req, tok, "", 1 << 20).rendered)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>tool\n3 C<|im_end|>" in text


def test_tool_fields_only_on_their_roles():
    bad = _request(messages=[{"role": "user", "content": "x", "tool_call_id": "c1"}])
    with pytest.raises(InvalidRequest, match="tool_call_id"):
        render_chat(_Tok(CHATML_TEMPLATE), bad.messages)
