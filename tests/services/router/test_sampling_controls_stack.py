"""Sampling controls and structured output through the real stack (router + prefill + decode processes, and the
gateway) with the official `openai` client: ignore_eos / min_tokens give exactly max_tokens tokens, logit_bias and
the penalties reach the sampler, unknown fields are a 400 naming them, continuous usage stats, and JSON schema /
regex / choice outputs of the random-weight model that follow their spec (the prefill side samples the first token
under the same constraint as the decode side)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint

MODEL = "tiny-sc"
EOS = 2  # build_checkpoint's eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "kind": {"enum": ["a", "b", "c"]},
        "label": {"type": "string", "pattern": "^[a-z ]{0,5}$"},  # see structured.py: random bytes
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2},
    },
    "required": ["id", "kind", "point"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
N = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = build_checkpoint(tmp_path_factory.mktemp("sc") / "ckpt", arch="llama", seed=9)
    with tiny_stack(
        model_dir, tmp_path_factory.mktemp("sc-stack"), kv_dtype="int8", gateway_port=0, model_name=MODEL
    ) as s:
        yield s


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=120)


def test_ignore_eos_and_min_tokens_give_max_tokens(oai):
    """EOS made the likeliest token by logit_bias: plain it ends the reply at once; ignore_eos + min_tokens run to
    max_tokens; min_tokens alone holds EOS back for min_tokens tokens."""
    bias = {str(EOS): 100}
    plain = oai.completions.create(model=MODEL, prompt="count:", max_tokens=24, temperature=0, logit_bias=bias)
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    full = oai.completions.create(
        model=MODEL,
        prompt="count:",
        max_tokens=24,
        logit_bias=bias,
        extra_body={"ignore_eos": True, "min_tokens": 24},
    )
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=16,
        temperature=0,
        logit_bias=bias,
        extra_body={"min_tokens": 7},
    )
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "stop"


def test_penalties_and_vllm_fields_are_honoured(stack, oai):
    """The same request through the SDK and the gateway gives the same tokens (the gateway forwards every field)."""
    kw = dict(presence_penalty=0.5, frequency_penalty=1.5)
    extra = dict(repetition_penalty=1.3, top_k=-1, stop_token_ids=[7])
    out = oai.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, **kw, extra_body=extra)
    with pdserve.Client(stack.router, timeout=60) as c:
        sdk = c.generate(prompt="abc", max_tokens=20, temperature=0, **kw, **{**extra, "top_k": 0})
        plain = c.generate(prompt="abc", max_tokens=20, temperature=0)
    assert out.choices[0].text == sdk.text and out.usage.completion_tokens == len(sdk.token_ids)
    assert sdk.token_ids != plain.token_ids  # the penalties changed the greedy reply


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"bogus_knob": 1}, "bogus_knob"),
        ({"guided_choice": []}, "guided_choice"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_fields_are_400_naming_them(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_a_regex_that_does_not_compile_is_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    assert "does not compile" in e.value.body["message"]


def test_continuous_usage_stats(oai):
    stream = oai.completions.create(
        model=MODEL,
        prompt="count:",
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True},
    )
    counts = [ev.usage.completion_tokens for ev in stream if ev.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 10 and len(counts) > 3


def test_json_schema_outputs_validate(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}
    for i in range(N):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"record {i}"}],
            max_tokens=120,
            temperature=1.0,
            seed=i,
            response_format=fmt,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_regex_and_choice_outputs_match(oai):
    choices = ["red", "green", "dark blue"]
    for i in range(N // 2):
        text = (
            oai.completions.create(
                model=MODEL, prompt=f"code {i}:", max_tokens=40, seed=i, extra_body={"guided_regex": REGEX}
            )
            .choices[0]
            .text
        )
        assert re.fullmatch(REGEX, text), text
        text = (
            oai.completions.create(
                model=MODEL, prompt=f"colour {i}:", max_tokens=40, seed=i, extra_body={"guided_choice": choices}
            )
            .choices[0]
            .text
        )
        assert text in choices
