"""The gateway in front of the real stack (router + prefill + decode processes), driven by the `openai` client:
completions and chat, streaming and not, equal to what the SDK gets for the same request."""

from __future__ import annotations

import openai
import pytest
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint

MODEL = "tiny-chat"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does assert do?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gw-llama") / "ckpt", arch="llama", seed=3)


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
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=CHAT, top_p=0, stream=True)


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
