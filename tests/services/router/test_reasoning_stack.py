"""Reasoning models through the real stack: a checkpoint whose tokenizer has <think>/</think> as added tokens and an
R1-like chat template that opens the think block. The router splits `reasoning_text` from `text` (unary, stream,
gateway `reasoning_content`), `max_reasoning_tokens` forces the close tag at decode (or at prefill for a budget of
0) and seeded sampling stays deterministic."""

from __future__ import annotations

import grpc
import openai
import pytest
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint, build_tokenizer

MODEL = "tiny-r1"
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    d = build_checkpoint(
        tmp_path_factory.mktemp("r1") / "ckpt", arch="qwen2", seed=9, vocab_size=512, max_position_embeddings=128
    )
    build_tokenizer(d, vocab_size=510, chat_template=R1_TEMPLATE)  # room for the two think tags in the vocab
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.add_tokens(["<think>", "</think>"])
    assert len(tok) == 512
    tok.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("r1-stack")
    with tiny_stack(model_dir, work, kv_dtype="int8", gateway_port=0, model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with pdserve.Client(stack.router, timeout=60) as c:
        yield c


SAMPLED = dict(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True)


def test_budget_forces_the_close_tag_and_the_split_follows(client, tok):
    close = tok.convert_tokens_to_ids("</think>")
    out = client.chat(CHAT, max_reasoning_tokens=5, **SAMPLED)
    assert out.token_ids[5] == close and close not in out.token_ids[:5]
    assert out.reasoning_text == tok.decode(out.token_ids[:5])
    assert out.text == tok.decode(out.token_ids[6:])
    assert out.reasoning_text + "</think>" + out.text == tok.decode(out.token_ids)
    again = client.chat(CHAT, max_reasoning_tokens=5, **SAMPLED)
    assert again.token_ids == out.token_ids  # seeded: deterministic with forcing
    free = client.chat(CHAT, **SAMPLED)  # no budget: the same draws up to the forced position
    assert free.token_ids[:5] == out.token_ids[:5]
    if close not in free.token_ids:
        assert free.text == "" and free.reasoning_text == tok.decode(free.token_ids)  # still thinking


def test_budget_zero_is_forced_at_prefill(client, tok):
    out = client.chat(CHAT, max_reasoning_tokens=0, **SAMPLED)
    assert out.token_ids[0] == tok.convert_tokens_to_ids("</think>") and out.reasoning_text == ""
    assert out.text == tok.decode(out.token_ids[1:])


def test_stream_split_equals_unary_and_split_can_be_turned_off(client):
    whole = client.chat(CHAT, max_reasoning_tokens=4, **SAMPLED)
    chunks = list(client.chat(CHAT, stream=True, max_reasoning_tokens=4, **SAMPLED))
    assert "".join(c.reasoning_text for c in chunks) == whole.reasoning_text
    assert "".join(c.text for c in chunks) == whole.text
    raw = client.chat(CHAT, max_reasoning_tokens=4, split_reasoning=False, **SAMPLED)
    assert raw.reasoning_text == "" and raw.text == whole.reasoning_text + "</think>" + whole.text


def test_plain_prompt_starts_outside_the_think_block(client, tok):
    out = client.generate(prompt="hello there", split_reasoning=True, temperature=0, max_tokens=6, ignore_eos=True)
    if tok.convert_tokens_to_ids("<think>") not in out.token_ids:
        assert out.reasoning_text == "" and out.text == tok.decode(out.token_ids)


def test_gateway_reasoning_content(stack, client):
    oai = openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=60)
    ref = client.chat(CHAT, max_reasoning_tokens=3, temperature=0, max_tokens=8)
    body = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=8, extra_body={"max_reasoning_tokens": 3})
    out = oai.chat.completions.create(**body)
    msg = out.choices[0].message
    assert msg.content == ref.text and msg.model_extra["reasoning_content"] == ref.reasoning_text
    deltas = [ev.choices[0].delta for ev in oai.chat.completions.create(stream=True, **body) if ev.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == ref.reasoning_text
    assert "".join(d.content or "" for d in deltas) == ref.text


def test_models_without_think_tags_reject_reasoning_fields(tmp_path):
    from transformers import AutoTokenizer

    from pdserve.router.reasoning import reasoning_tags

    plain = build_checkpoint(tmp_path / "plain", arch="llama", seed=1)
    assert reasoning_tags(AutoTokenizer.from_pretrained(str(plain))) is None


def test_reasoning_budget_must_be_non_negative(client):
    with pytest.raises(grpc.RpcError) as e:
        client.chat(CHAT, max_reasoning_tokens=-1, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_reasoning_tokens" in e.value.details()
