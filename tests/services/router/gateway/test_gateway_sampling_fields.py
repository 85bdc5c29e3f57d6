"""Each OpenAI / vLLM sampling field the gateway takes lands on its gRPC API field (protocol.sampling_args →
the SDK's build_request), with OpenAI's and vLLM's spellings."""

from __future__ import annotations

import json

from pdserve.client import build_request
from pdserve.router.gateway import protocol

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def request_of(body: dict, chat: bool = False):
    inputs = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    return build_request(**inputs, **protocol.sampling_args({"model": "m", **inputs, **body}, chat))


def test_every_sampling_field_is_forwarded():
    body = {
        "max_tokens": 9,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.25,
        "logit_bias": {"17": -100, "3": 4.5},
        "min_tokens": 4,
        "ignore_eos": True,
        "stop_token_ids": [8, 9],
        "top_k": 20,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    req = request_of(body)
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert dict(s.logit_bias) == {17: -100.0, 3: 4.5} and s.min_tokens == 4 and s.ignore_eos
    assert list(s.stop_token_ids) == [8, 9] and s.top_k == 20 and req.stream_usage
    unset = request_of({}).sampling
    assert not any(unset.HasField(f) for f in ("presence_penalty", "repetition_penalty", "min_tokens", "structured"))
    assert request_of({"top_k": -1}).sampling.top_k == 0  # vLLM's "off"


def test_structured_output_spellings():
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    assert json.loads(request_of({"response_format": fmt}, chat=True).sampling.structured.json_schema) == SCHEMA
    assert request_of({"response_format": {"type": "json_object"}}, chat=True).sampling.structured.json_object
    assert not request_of({"response_format": {"type": "text"}}).sampling.HasField("structured")
    assert json.loads(request_of({"guided_json": SCHEMA}).sampling.structured.json_schema) == SCHEMA
    assert request_of({"guided_regex": "a+"}).sampling.structured.regex == "a+"
    assert list(request_of({"guided_choice": ["x", "y"]}).sampling.structured.choice.choices) == ["x", "y"]
    assert request_of({"guided_grammar": 'root ::= "a"'}).sampling.structured.grammar == 'root ::= "a"'
