"""Tool calling through the real stack (router + prefill + decode processes, and the gateway) with the official
`openai` client, on a random-weight model whose chat template renders tools (Qwen2.5 style, Hermes calls): a named
tool_choice and `required` always give calls that parse and validate against the tool's parameters (only the
grammar engine can make a random model do that), streamed deltas reassemble to the same call, tool turns in the
history are rendered by the template, and bad tool fields are a 400 naming them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint

MODEL = "tiny-tools"
# Qwen2.5's template, cut to what matters here: tools in the system turn, calls as <tool_call> blocks, tool results
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    '</tools>\nCall a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
N = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("tools") / "ckpt", arch="qwen2", seed=4, chat_template=TOOLS_TEMPLATE
    )


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("tools-stack")
    with tiny_stack(model_dir, work, kv_dtype="auto", num_pages=512, gateway_port=0, model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=120)


def _valid_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_named_tool_choice_always_gives_a_valid_call(oai):
    for seed in range(N):
        out = oai.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed, max_tokens=200
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [name for name, _ in _valid_calls(choice.message)] == ["get_weather"]
        assert choice.message.content is None


def test_required_gives_valid_calls(oai):
    names = set()
    for seed in range(N):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        calls = _valid_calls(out.choices[0].message)
        assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
        names.add(calls[0][0])
    assert names <= set(SCHEMAS)


def test_streamed_deltas_reassemble_to_the_same_call(oai):
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=11, max_tokens=200)
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = []
    pieces = 0
    for event in oai.chat.completions.create(**kw, stream=True):
        choice = event.choices[0]
        assert not choice.delta.content  # only calls
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: its id, type and name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments
                pieces += 1
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert finish == ["tool_calls"] and pieces > 1  # the arguments came in several pieces
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_tool_turns_in_history_are_rendered(oai, stack, model_dir):
    """An assistant turn's calls and the tool's answer reach the template as transformers renders them."""
    from transformers import AutoTokenizer

    arguments = '{"city": "Oslo", "days": 2}'
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason != "tool_calls"
    rendered = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0]}]}, history[2]]
    rendered[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": json.loads(arguments)}
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert "sunny, 21 C" in tok.decode(ids) and "<tool_call>" in tok.decode(ids)
    assert out.usage.prompt_tokens == len(ids)  # tool_choice none: the tools are not rendered
    with_tools = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice=NAMED, max_tokens=200
    )
    expected = tok.apply_chat_template(
        rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert with_tools.usage.prompt_tokens == len(expected)
    assert _valid_calls(with_tools.choices[0].message)


def test_sdk_exposes_tool_calls(stack):
    with pdserve.Client(stack.router, timeout=120) as c:
        out = c.chat(CHAT, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=200)
        assert out.finish_reason == "tool_calls" and out.text == ""
        assert [call.name for call in out.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(out.tool_calls[0].arguments), WEATHER)
        chunks = list(c.chat(CHAT, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=200, stream=True))
        deltas = [d for ch in chunks for d in ch.tool_calls]
        assert deltas[0].id and deltas[0].name == "get_weather"
        assert "".join(d.arguments for d in deltas) == out.tool_calls[0].arguments
        with pytest.raises(pdserve.client.grpc.RpcError) as info:
            c.chat(CHAT, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
        assert info.value.code().name == "INVALID_ARGUMENT" and "'nope'" in info.value.details()


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools", "colour"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ],
)
def test_bad_tool_fields_are_400_naming_them(oai, extra, param, words):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param and words in info.value.body["message"], info.value.body


def test_tool_message_needs_its_call_id(oai):
    history = [*CHAT, {"role": "tool", "content": "21 C"}]
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        oai.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
