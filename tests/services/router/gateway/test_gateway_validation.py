"""Field ranges, encodings and header bytes the gateway refuses with a 4xx in the OpenAI error shape (`param` the
field at fault), before calling the router: each red-team input that once gave a 500 with a traceback, OpenAI's
documented ranges, the router's own 400s with their `param`, and unknown URLs / methods."""

from __future__ import annotations

import json
import socket

import pytest
from gateway_testutil import INVALID_PREFIX, post, read_response, running_gateway, scripted_router

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "ok"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with scripted_router() as (servicer, router):
        work = tmp_path_factory.mktemp("gw-validation")
        with running_gateway(router, work) as address:
            yield servicer, address, work


def _refused(gateway, path: str, body: bytes, headers=None) -> tuple[int, dict]:
    """(status, error object) of a request the gateway answers itself: the router is never called."""
    servicer, address, _ = gateway
    before = len(servicer.metadata)
    status, answer = post(address, path, body, headers)
    assert len(servicer.metadata) == before, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return status, answer["error"]


RED_TEAM_BODIES = [  # (path, body, param): each was a 500 with a traceback
    ("/v1/completions", b'{"model": "m", "prompt": "ok", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("/v1/completions", b'{"model": "m", "prompt": "ok", "max_tokens": 1e12}', "max_tokens"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 2**40}).encode(), "max_tokens"),
    ("/v1/completions", json.dumps({**COMPLETION, "seed": 2**70}).encode(), "seed"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": [2**40]}).encode(), "prompt"),
    ("/v1/completions", b'{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
]


@pytest.mark.parametrize("path,body,param", RED_TEAM_BODIES, ids=lambda v: str(v)[:24])
def test_red_team_bodies_are_400(gateway, path, body, param):
    status, error = _refused(gateway, path, body)
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize(
    "header,value,status",
    [("authorization", b"Bearer sk-valid\x7f", 401), ("x-priority", b"\x7f", 400), ("x-priority", b"a" * 5000, 400)],
)
def test_header_bytes_grpc_refuses(gateway, header, value, status):
    got, error = _refused(gateway, "/v1/completions", json.dumps(COMPLETION).encode(), {header: value})
    assert got == status and header.replace("authorization", "Authorization") in error["message"], error


def test_a_bad_trace_header_is_dropped(gateway):
    servicer, address, _ = gateway
    status, answer = post(address, "/v1/completions", json.dumps(COMPLETION).encode(), {"traceparent": b"a\tb"})
    assert status == 200 and answer["choices"][0]["text"] == "hello"
    assert "traceparent" not in servicer.metadata[-1]


def _case_id(case) -> str:
    return json.dumps(case[0])[:40] if isinstance(case, tuple) else str(case)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"temperature": 5}, "temperature"),  # OpenAI's range 0..2
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"top_k": -2}, "top_k"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"stream_options": {"continuous_usage_stats": 1}, "stream": True}, "stream_options"),
        ({"stream_options": {"what": True}, "stream": True}, "stream_options"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"mystery": 1}, "mystery"),  # unknown: a 400 naming it, never silently ignored
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # a chat field on /v1/completions
        ({"n": 17}, "n"),  # MAX_N choices
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),  # the gRPC API's int32
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"seed": 2**63}, "seed"),  # OpenAI's int64
        ({"seed": "7"}, "seed"),
        ({"max_reasoning_tokens": 2**31}, "max_reasoning_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options"),
        ({"stop": [1]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [1, 2**31]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"model": None}, "model"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
    ids=_case_id,
)
def test_completion_ranges(gateway, extra, param):
    status, error = _refused(gateway, "/v1/completions", json.dumps({**COMPLETION, **extra}).encode())
    assert status == 400 and error["param"] == param, error


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"temperature": 2.5}, "temperature"),
        ({"echo": True}, "echo"),  # a completions field on /v1/chat/completions
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
    ids=_case_id,
)
def test_chat_ranges(gateway, extra, param):
    status, error = _refused(gateway, "/v1/chat/completions", json.dumps({**CHAT, **extra}, ensure_ascii=True).encode())
    assert status == 400 and error["param"] == param, error


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "ok", "temperature": NaN}',  # not JSON (Python's json would take it)
        b'{"model": "m", "prompt": "ok", "seed": ' + b"9" * 5000 + b"}",  # over Python's int digits limit
        b"\xff\xfe\x00",
        b"[1, 2]",
        b'{"model": "m", "prompt": "ok"',
    ],
    ids=lambda b: b[:24].decode("latin-1"),
)
def test_not_a_json_object_is_400(gateway, body):
    status, error = _refused(gateway, "/v1/completions", body)
    assert status == 400 and error["code"] == "invalid_json", error


def test_edges_of_the_ranges_are_accepted(gateway):
    servicer, address, _ = gateway
    for extra in (
        {"temperature": 2, "top_p": 1, "seed": -(2**63), "max_tokens": 2**31 - 1, "presence_penalty": 0.0},
        {"temperature": 0, "seed": 2**63 - 1, "n": 1, "logprobs": 20, "prompt": [0, 2**31 - 1]},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 2, "min_tokens": 0, "top_k": -1},
        {"logit_bias": {"0": -100, str(2**31 - 1): 100}, "stop_token_ids": [0, 2**31 - 1], "ignore_eos": True},
        {"response_format": {"type": "text"}, "user": "u", "guided_choice": ["a"]},
    ):
        status, answer = post(address, "/v1/completions", json.dumps({**COMPLETION, **extra}).encode())
        assert status == 200, answer


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_router_400s_name_the_param(gateway, chat, stream):
    """The router's INVALID_ARGUMENT reason names a gRPC field: `param` is the OpenAI parameter set with it."""
    _, address, _ = gateway
    cases = [
        ("top_p must be in (0, 1], got 0.0", {}, "top_p"),
        ("max_tokens 900 exceeds the model context of 512 tokens", {}, "max_tokens"),
        ("max_tokens 900 exceeds the context of 512", {"max_completion_tokens": 900}, "max_completion_tokens"),
        ("prompt has 600 tokens; the model context is 512 tokens", {}, "messages" if chat else "prompt"),
        ("top_logprobs must be an integer in [0, 20], got 30", {}, "top_logprobs" if chat else "logprobs"),
        ("messages[0].role must be one of system, user", {}, "messages"),
        ("x-priority must be high, normal or low, not 'urgent'", {}, None),
    ]
    for reason, extra, param in cases:
        script = INVALID_PREFIX + reason  # the scripted router answers INVALID_ARGUMENT with `reason`
        if chat:
            path, body = "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": script}]}
        else:
            path, body = "/v1/completions", {**COMPLETION, "prompt": script}
        status, answer = post(address, path, json.dumps({**body, **extra, "stream": stream}).encode())
        assert status == 400 and answer["error"]["message"] == reason, answer
        assert answer["error"]["param"] == param, (reason, answer)


@pytest.mark.parametrize(
    "method,path,status,code",
    [("POST", "/v1/nothing", 404, "unknown_url"), ("GET", "/v1/completions", 405, "method_not_allowed")],
)
def test_unknown_url_and_method_in_openai_shape(gateway, method, path, status, code):
    _, (host, port), _ = gateway
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode())
        got, _, body = read_response(s)
    assert got == status
    error = json.loads(body)["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": None, "code": code}
    assert path in error["message"] and method in error["message"]


def test_no_traceback_in_the_log_for_bad_input(gateway):
    """Every refusal above is a plain 4xx: the gateway's log holds no traceback (this module's gateway log)."""
    _, _, work = gateway
    text = "".join(p.read_text() for p in work.glob("gateway*.log"))
    assert "Traceback" not in text and "Exception in ASGI application" not in text
