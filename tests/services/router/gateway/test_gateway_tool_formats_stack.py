"""The Llama 3.x JSON and Mistral `[TOOL_CALLS]` tool-call formats through the real stack (the Hermes one:
test_gateway_tools_stack.py): one router serving two random-weight models (a colocated instance each) whose chat
templates carry each format's markers, and the gateway, driven by the official `openai` client. Per format: a
named tool_choice gives a call that parses and validates against the tool's parameters, written in that format
(the raw tokens, seen through logprobs); the prompt renders the tools as transformers does; the streamed deltas
reassemble to the same call; the call goes back into the history (Mistral's template refuses any id but 9 letters
and digits)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from services_testutil import tiny_stack

from pdserve.models.checkpoints import build_checkpoint

LLAMA, MISTRAL = "llama3-tools", "mistral-tools"
# Llama 3.1's template cut to its tool parts: tools in a system turn, a call is {"name", "parameters"} JSON (built-in
# tools after <|python_tag|>), results in an ipython turn
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nRespond with a JSON object "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m.tool_calls %}"
    "{%- if builtin_tools is defined and c.function.name in builtin_tools %}<|python_tag|>{{ c.function.name }}"
    '{%- else %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endif %}'
    "{%- endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral's v3 template cut to its tool parts: [AVAILABLE_TOOLS], calls after [TOOL_CALLS] as one JSON array,
# call ids of exactly 9 characters, [TOOL_RESULTS]
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] "
    '{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{%- if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}'
    "{%- if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{%- else %}{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
CHAT = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# how each format's raw output starts (the grammar writes the call in the model's own format)
RAW = {
    LLAMA: re.compile(r'\{"name": "get_weather", "parameters": \{'),
    MISTRAL: re.compile(r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{'),
}
CALL_ID = {LLAMA: re.compile(r"call_[0-9a-f]{24}"), MISTRAL: re.compile(r"[A-Za-z0-9]{9}")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tool-formats")
    return {
        LLAMA: build_checkpoint(base / LLAMA, arch="llama", seed=7, chat_template=LLAMA3_TEMPLATE),
        MISTRAL: build_checkpoint(base / MISTRAL, arch="mistral", seed=8, chat_template=MISTRAL_TEMPLATE),
    }


@pytest.fixture(scope="module")
def oai(model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("tool-formats-stack")
    with tiny_stack(
        model_dirs[LLAMA], work, kv_dtype="auto", num_pages=512, num_colocated=1, gateway_port=0, model_name=LLAMA,
        more_models=[(MISTRAL, str(model_dirs[MISTRAL]))],
    ) as s:  # fmt: skip
        yield openai.OpenAI(base_url=f"http://{s.gateway}/v1", api_key="none", max_retries=0, timeout=120)


def _one_valid_call(message, model: str):
    """The message's only call, checked: get_weather, an id of the format's form, arguments valid JSON for it."""
    assert message.content is None and len(message.tool_calls or []) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert CALL_ID[model].fullmatch(call.id), call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    return call


@pytest.mark.parametrize("model", [LLAMA, MISTRAL])
def test_named_tool_choice_gives_a_valid_call_in_the_models_format(oai, model_dirs, model):
    from transformers import AutoTokenizer

    for seed in range(3):
        out = oai.chat.completions.create(
            model=model, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed, max_tokens=120,
            logprobs=True,
        )  # fmt: skip
        choice = out.choices[0]
        assert out.model == model and choice.finish_reason == "tool_calls", choice
        _one_valid_call(choice.message, model)
        raw = "".join(t.token for t in choice.logprobs.content)  # the tokens the model wrote, calls included
        assert RAW[model].match(raw), raw
    tok = AutoTokenizer.from_pretrained(str(model_dirs[model]))
    expected = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.usage.prompt_tokens == len(expected)  # the tools rendered by the model's own template


@pytest.mark.parametrize("model", [LLAMA, MISTRAL])
def test_streamed_call_and_history_round_trip(oai, model):
    kw = dict(model=model, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=5, max_tokens=120)
    first = oai.chat.completions.create(**kw)
    call = _one_valid_call(first.choices[0].message, model)
    pieces: dict[int, dict] = {}
    finish = []
    for event in oai.chat.completions.create(**kw, stream=True):
        choice = event.choices[0]
        assert not choice.delta.content
        for d in choice.delta.tool_calls or []:
            piece = pieces.setdefault(d.index, {"name": "", "arguments": ""})
            piece["name"] += d.function.name or ""
            piece["arguments"] += d.function.arguments or ""
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert finish == ["tool_calls"]
    assert list(pieces.values()) == [{"name": "get_weather", "arguments": call.function.arguments}]
    # the call and its result go back to the model: its template renders them (Mistral's checks the id)
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    again = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice=NAMED, max_tokens=120)
    _one_valid_call(again.choices[0].message, model)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    if model == MISTRAL:  # the template's id check is live: another id form is refused
        history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_1"
        with pytest.raises(openai.BadRequestError, match="length 9"):
            oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4)
