"""Gateway error mapping and metadata, driven by the official `openai` client against a gateway process whose
router is a scripted gRPC Generation server (each prompt names the status it answers with)."""

from __future__ import annotations

import time

import openai
import pytest
from gateway_testutil import running_gateway, scripted_router

from pdserve.cli.launch import start_service, wait_ready

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A gateway that answers the router's pushback at once (the mapping itself; the wait is tested below)."""
    with scripted_router() as (servicer, router):
        servicer.target = router  # a second gateway in front of the same router (the pushback wait test)
        with running_gateway(router, tmp_path_factory.mktemp("gw-scripted"), "--pushback-wait-s", "0") as (host, port):
            base = f"http://{host}:{port}/v1"
            yield servicer, openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=30)


@pytest.mark.parametrize(
    "code,status",
    [
        ("INVALID_ARGUMENT", 400),
        ("RESOURCE_EXHAUSTED", 429),
        ("DEADLINE_EXCEEDED", 504),
        ("UNAVAILABLE", 503),
        ("INTERNAL", 500),
        ("NOT_FOUND", 404),  # the router's only NOT_FOUND: a model it does not serve
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_status_mapping(scripted, code, status, stream):
    _, client = scripted
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="m", prompt=code, stream=stream)
    e = info.value
    assert e.status_code == status
    assert e.body["message"] == f"scripted {code}"
    assert e.body["code"] == ("model_not_found" if code == "NOT_FOUND" else code.lower())
    if code == "RESOURCE_EXHAUSTED":
        assert e.response.headers["retry-after"] == "3"  # 2500 ms, rounded up to whole seconds
    else:
        assert "retry-after" not in e.response.headers


def test_pushback_is_waited_out_within_the_gateways_bound(scripted, tmp_path):
    """With --pushback-wait-s 3 and the router's 2.5 s pushback, the gateway tries the router once more after the
    pushback (not at once, not a third time: 5 s would pass its bound), then answers 429; at 0 (the fixture) it
    answers after the first refusal."""
    servicer, _ = scripted
    with running_gateway(servicer.target, tmp_path, "--pushback-wait-s", "3") as (host, port):
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=30)
        before, t0 = len(servicer.metadata), time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="m", prompt="RESOURCE_EXHAUSTED")
        waited = time.monotonic() - t0
    assert len(servicer.metadata) - before == 2
    assert 2.5 <= waited < 4.5, waited
    assert info.value.response.headers["retry-after"] == "3"
    _, fast = scripted
    before, t0 = len(servicer.metadata), time.monotonic()
    with pytest.raises(openai.RateLimitError):
        fast.completions.create(model="m", prompt="RESOURCE_EXHAUSTED")
    assert len(servicer.metadata) - before == 1 and time.monotonic() - t0 < 2.0


def test_traceparent_passed_on(scripted):
    servicer, client = scripted
    out = client.completions.create(
        model="m", prompt="ok", extra_headers={"traceparent": TRACEPARENT, "x-priority": "high"}
    )
    assert out.choices[0].text == "hello" and out.usage.total_tokens == 3
    assert servicer.metadata[-1]["traceparent"] == TRACEPARENT and servicer.metadata[-1]["x-priority"] == "high"
    client.completions.create(model="m", prompt="ok")
    assert "traceparent" not in servicer.metadata[-1]


def test_gateway_rejects_before_calling_the_router(scripted):
    servicer, client = scripted
    before = len(servicer.metadata)
    cases = [
        dict(n=17),  # beyond MAX_N (n itself is served)
        dict(logprobs=21),
        dict(logprobs=-1),
        dict(echo="yes"),
        dict(stop=["a", "b", "c", "d", "e"]),
        dict(max_tokens="many"),
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="m", prompt="ok", **extra)
        assert info.value.body["type"] == "invalid_request_error", extra
    for extra in (dict(logprobs=True, top_logprobs=21), dict(top_logprobs=2), dict(logprobs=True, top_logprobs=1.5)):
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **extra)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="ok")
    assert info.value.body["code"] == "model_not_found"
    assert len(servicer.metadata) == before


def test_ready_follows_the_router(scripted, tmp_path):
    """/health answers while the process runs; /ready only while the router's Generation service is SERVING
    (the scripted router has no health service: not ready)."""
    import json
    import urllib.error
    import urllib.request

    _, client = scripted
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{base}/ready", timeout=10)
    assert info.value.code == 503 and "not ready" in json.loads(info.value.read())["error"]["message"]


def test_router_down_is_503(tmp_path):
    import socket

    dead = socket.socket()  # bound, never listening: connections to it are refused, and no one else can take it
    dead.bind(("127.0.0.1", 0))
    router = f"127.0.0.1:{dead.getsockname()[1]}"
    proc, ready, log = start_service("gateway", ["--router", router, "--model-name", "m"], tmp_path)
    try:
        address = wait_ready(proc, ready, log, timeout=60)
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="m", prompt="ok")
        assert info.value.status_code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        dead.close()


def test_oversized_body_is_413_before_parsing(scripted):
    """The body limit (--max-body-mb, 8 MiB) holds for a declared length and for a chunked body alike."""
    import http.client
    import json
    from urllib.parse import urlsplit

    servicer, client = scripted
    before = len(servicer.metadata)
    base = urlsplit(str(client.base_url))
    big = b'{"model": "m", "prompt": "' + b"x" * (9 << 20) + b'"}'

    def post(body, **kw) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(base.hostname, base.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"}, **kw)
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    chunks = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    for status, body in (post(big), post(chunks, encode_chunked=True)):
        assert status == 413, body
        assert body["error"]["code"] == "body_too_large"
    assert len(servicer.metadata) == before
