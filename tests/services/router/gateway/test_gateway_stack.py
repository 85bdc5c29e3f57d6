"""The gateway in front of the real stack (router + prefill + decode processes), driven by the `openai` client:
completions and chat, streaming and not, equal to what the SDK gets for the same request; then a fuzz of the
OpenAI request schemas (`openai_schemas`, Hypothesis, seeded) never gets a 500 nor leaves a traceback in the log.
The tiny model's context is 128 tokens: it bounds every generation the fuzz asks for."""

from __future__ import annotations

import json

import openai
import pytest
from gateway_testutil import exchange
from hypothesis import HealthCheck, given, settings
from openai_schemas import HEADERS, requests
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint

MODEL = "tiny-chat"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does assert do?"}]
CONTEXT = 128  # the checkpoint's max_position_embeddings
FUZZ_EXAMPLES = 150


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("gw-llama") / "ckpt", arch="llama", seed=3, max_position_embeddings=CONTEXT
    )


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("gw-stack")
    with tiny_stack(model_dir, work, kv_dtype="auto", chunk_size=16, gateway_port=0, model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_sdk(stack, client):
    out = client.completions.create(model=MODEL, prompt="The assert statement", max_tokens=8, temperature=0)
    with pdserve.Client(stack.router, timeout=60) as c:
        ref = c.generate(prompt="The assert statement", max_tokens=8, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == ref.usage.completion_tokens == len(ref.token_ids)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    by_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    with pdserve.Client(stack.router, timeout=60) as c:
        assert by_ids.choices[0].text == c.generate(token_ids=[5, 6, 7, 8], max_tokens=4, temperature=0).text


def test_completion_stream_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt="Exceptions are", max_tokens=10, temperature=0)
    events = list(
        client.completions.create(
            model=MODEL,
            prompt="Exceptions are",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(e.choices[0].text for e in events if e.choices) == whole.choices[0].text
    finishes = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(e.usage is None for e in events[:-1])


def test_chat_equals_template_rendering(stack, client, model_dir):
    """The router renders messages with the tokenizer's template exactly as transformers does."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with pdserve.Client(stack.router, timeout=60) as c:
        ref = c.generate(token_ids=list(ids), max_tokens=8, temperature=0)
        via_sdk = c.generate(messages=CHAT, max_tokens=8, temperature=0)
    assert via_sdk.token_ids == ref.token_ids and via_sdk.usage.prompt_tokens == len(ids)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref.token_ids)


def test_chat_stream_stop_and_seed(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, seed=11)
    whole = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert again.choices[0].message.content == whole.choices[0].message.content  # seeded: reproducible
    events = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == whole.choices[0].message.content
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = whole.choices[0].message.content
    assert len(text) >= 4 and whole.choices[0].finish_reason == "length"
    cut = text[2:4]  # stop on a piece of the seeded answer: it ends just before it, finish_reason stop
    stopped = client.chat.completions.create(**kw, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(cut)]


def test_router_errors_reach_the_client(client):
    """Refused by the gateway (max_tokens 0) or by the router (its reasons): a 400 whose `param` is the field."""
    with pytest.raises(openai.BadRequestError, match="max_tokens") as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="role") as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="top_p") as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, top_p=0, stream=True)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError, match="token") as info:  # the router's vocabulary check
        client.completions.create(model=MODEL, prompt=[5, 100_000])
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="context") as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * CONTEXT}])
    assert info.value.body["param"] == "messages"


def test_reflection_lists_and_resolves_the_api(stack):
    """What grpcurl does: list the router's services and resolve GenerateRequest (with its chat messages)."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from pdserve.server.grpc_util import channel

    with channel(stack.router) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services
        assert "pdserve.v1.Registry" not in services  # internal: served on the router's internal port only
        pool = DescriptorPool(db)
        req = pool.FindMessageTypeByName("pdserve.v1.GenerateRequest")
        assert {"prompt", "token_ids", "messages", "sampling"} <= set(req.fields_by_name)
        assert req.fields_by_name["messages"].message_type.full_name == "pdserve.v1.ChatMessage"
        rpc = pool.FindServiceByName("pdserve.v1.Generation").methods_by_name["GenerateStream"]
        assert rpc.output_type.full_name == "pdserve.v1.GenerateStreamResponse"
    with channel(stack.router.internal) as ch:
        assert "pdserve.v1.Registry" in set(ProtoReflectionDescriptorDatabase(ch).get_services())


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests(MODEL), headers=HEADERS)
def test_fuzz_never_answers_500(stack, request, headers):
    path, body = request
    host, port = stack.gateway.rsplit(":", 1)
    status, answer = exchange((host, int(port)), path, body, headers)
    assert status != 500, (path, body[:300], headers, answer[:500])
    if status != 200:
        error = json.loads(answer)["error"]  # every refusal is the OpenAI error object
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert status < 500 or status in (503, 504), (status, error)


def test_after_the_fuzz_no_traceback_and_still_serving(stack, client):
    out = client.completions.create(model=MODEL, prompt="The assert statement", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    log = next(p for p in stack.logs if p.name.startswith("gateway")).read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
