"""Logprobs, prompt logprobs and chat through the real stack (router + prefill + decode processes), checked against
HF transformers' log_softmax on the same fp32 weights; the SDK (sync and async), and the gateway with the `openai`
client. Also the per-API-shape max_tokens defaults and PCS counting a chat prompt's special tokens."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
import torch
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.router.chat import chat_prompt_ids
from pdserve.router.pcs import count_special, special_token_ids

MODEL = "tiny-lp"
CONTEXT = 96
PROMPT = [5, 17, 99, 23, 8, 250, 31, 77, 12, 400, 3, 66, 90, 41, 7, 300, 11, 19, 45]  # 19 tokens: 3 chunks of 8
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does assert do?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("lp") / "ckpt", arch="llama", seed=5, max_position_embeddings=CONTEXT
    )


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("lp-stack")
    with tiny_stack(
        model_dir, work, kv_dtype="auto", extra=["--dtype", "float32"], gateway_port=0, model_name=MODEL
    ) as s:
        yield s


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i = log P(. | ids[:i + 1])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_equal_hf(stack, hf):
    model, tok = hf
    with pdserve.Client(stack.router, timeout=60) as c:
        out = c.generate(
            token_ids=PROMPT,
            max_tokens=6,
            temperature=0,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=4,
            prompt_logprobs=True,
        )
    ref = hf_logprobs(model, PROMPT + out.token_ids)
    n = len(PROMPT)
    assert out.token_ids == [int(ref[n - 1 + i].argmax()) for i in range(6)]  # greedy = HF's argmax chain
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for i, lp in enumerate(out.logprobs):
        row = ref[n - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top = torch.topk(row, 4)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.token == tok.decode([lp.token_id]) and lp.top[0].token == tok.decode([lp.top[0].token_id])
    p = out.prompt_logprobs
    assert p.token_ids == PROMPT and p.tokens == [tok.decode([t]) for t in PROMPT]
    assert p.logprobs == pytest.approx([ref[i, PROMPT[i + 1]].item() for i in range(n - 1)], abs=1e-4)
    assert len(p.top) == n - 1  # top_logprobs=4 gives the prompt positions their alternatives too
    for i, alts in enumerate(p.top):
        top = torch.topk(ref[i], 4)
        assert [t.token_id for t in alts] == top.indices.tolist()
        assert [t.logprob for t in alts] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in alts] == [tok.decode([t]) for t in top.indices.tolist()]


def test_stream_carries_the_same_logprobs(stack):
    kw = dict(token_ids=PROMPT, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    with pdserve.Client(stack.router, timeout=60) as c:
        whole = c.generate(**kw)
        chunks = list(c.stream(**kw))
    assert [lp for ch in chunks for lp in (ch.logprobs or [])] == whole.logprobs
    assert all(len(ch.logprobs or []) == len(ch.token_ids) for ch in chunks)
    assert chunks[0].prompt_logprobs == whole.prompt_logprobs and all(ch.prompt_logprobs is None for ch in chunks[1:])
    assert all(lp.top == [] for lp in whole.logprobs)  # logprobs without top_logprobs: no alternatives


def test_sampled_logprobs_are_the_untempered_distribution(stack, hf):
    """temperature changes the draw, never the reported distribution (documented: before temperature)."""
    with pdserve.Client(stack.router, timeout=60) as c:
        out = c.generate(token_ids=PROMPT, max_tokens=4, temperature=1.7, seed=3, ignore_eos=True, logprobs=True)
    ref = hf_logprobs(hf[0], PROMPT + out.token_ids)
    want = [ref[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("top", [21, -1])
def test_top_logprobs_out_of_range_is_invalid(stack, top):
    with pdserve.Client(stack.router, timeout=60) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(token_ids=PROMPT, max_tokens=2, top_logprobs=top)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in e.value.details()


def test_chat_sync_async_and_max_tokens_defaults(stack, hf):
    tok = hf[1]
    ids = chat_prompt_ids(tok, [type("M", (), m) for m in CHAT])
    assert count_special(ids, special_token_ids(tok)) >= 4  # <|im_start|>/<|im_end|> per turn: PCS's special term
    with pdserve.Client(stack.router, timeout=60) as c:
        # chat: max_tokens unset = until EOS or the context ends (OpenAI chat); prompt: 16 (OpenAI completions)
        reply = c.chat(CHAT, temperature=0, ignore_eos=True)
        assert reply.finish_reason == "length" and reply.usage.completion_tokens == CONTEXT - len(ids)
        assert reply.usage.prompt_tokens == len(ids)
        assert c.generate(prompt="hello", ignore_eos=True).usage.completion_tokens == 16
        short = c.chat(CHAT, temperature=0, max_tokens=5)
        streamed = list(c.chat(CHAT, stream=True, temperature=0, max_tokens=5))
    assert "".join(ch.text for ch in streamed) == short.text
    assert [t for ch in streamed for t in ch.token_ids] == short.token_ids == reply.token_ids[: len(short.token_ids)]

    async def run_async():
        async with pdserve.AsyncClient(stack.router, timeout=60) as ac:
            whole = await ac.chat(CHAT, temperature=0, max_tokens=5)
            parts = [ch async for ch in ac.chat(CHAT, stream=True, temperature=0, max_tokens=5)]
        return whole, parts

    whole, parts = asyncio.run(run_async())
    assert whole.text == short.text and whole.token_ids == short.token_ids
    assert "".join(ch.text for ch in parts) == short.text


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=60)


def test_gateway_chat_logprobs(stack, oai):
    with pdserve.Client(stack.router, timeout=60) as c:
        ref = c.chat(CHAT, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    out = oai.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in ref.logprobs])
    assert [e.token for e in content] == [lp.token for lp in ref.logprobs]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [
        pytest.approx([t.logprob for t in lp.top]) for lp in ref.logprobs
    ]
    assert content[0].bytes == list(ref.logprobs[0].token.encode())
    stream = oai.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=5, logprobs=True, stream=True
    )
    streamed = [e for ev in stream if ev.choices and ev.choices[0].logprobs for e in ev.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([lp.logprob for lp in ref.logprobs])
    plain = oai.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=5)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=21)


def test_gateway_completion_logprobs_and_echo(stack, oai):
    with pdserve.Client(stack.router, timeout=60) as c:
        ref = c.generate(
            token_ids=PROMPT, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2, prompt_logprobs=True
        )
    out = oai.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2, echo=True)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs.logprobs + [x.logprob for x in ref.logprobs])
    assert lp.tokens == ref.prompt_logprobs.tokens + [x.token for x in ref.logprobs]
    assert out.choices[0].text == "".join(ref.prompt_logprobs.tokens) + ref.text
    assert lp.text_offset[1] == len(lp.tokens[0])
    assert list(lp.top_logprobs[-1].values()) == pytest.approx([t.logprob for t in ref.logprobs[-1].top])
    assert lp.top_logprobs[0] is None  # the prompt's first token has no context; the others their alternatives
    assert lp.top_logprobs[1] == pytest.approx({t.token: t.logprob for t in ref.prompt_logprobs.top[0]})
    no_echo = oai.completions.create(model=MODEL, prompt="The assert", temperature=0, max_tokens=3, logprobs=0)
    assert len(no_echo.choices[0].logprobs.token_logprobs) == no_echo.usage.completion_tokens
    echoed = oai.completions.create(model=MODEL, prompt="The assert", temperature=0, max_tokens=3, echo=True)
    assert (
        echoed.choices[0].text
        == "The assert"
        + oai.completions.create(model=MODEL, prompt="The assert", temperature=0, max_tokens=3).choices[0].text
    )


def test_reasoning_fields_need_a_reasoning_model(stack):
    with pdserve.Client(stack.router, timeout=60) as c:
        for kw in (dict(max_reasoning_tokens=4), dict(split_reasoning=True)):
            with pytest.raises(grpc.RpcError) as e:
                c.chat(CHAT, max_tokens=2, **kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "<think>" in e.value.details()
        assert c.chat(CHAT, max_tokens=2, split_reasoning=False).reasoning_text == ""


def test_gateway_defaults_agree_with_the_sdk(stack, oai):
    """Unset max_tokens: chat runs until EOS or the context ends, completions stop at 16 (OpenAI's defaults), the
    same through the SDK and the gateway."""
    with pdserve.Client(stack.router, timeout=60) as c:
        chat_ref = c.chat(CHAT, temperature=0)
        prompt_ref = c.generate(prompt="The assert", temperature=0)
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    assert chat.choices[0].message.content == chat_ref.text
    assert chat.usage.completion_tokens == chat_ref.usage.completion_tokens
    left = CONTEXT - chat_ref.usage.prompt_tokens
    assert chat_ref.finish_reason == "stop" or chat_ref.usage.completion_tokens == left
    done = oai.completions.create(model=MODEL, prompt="The assert", temperature=0)
    assert done.choices[0].text == prompt_ref.text
    assert done.usage.completion_tokens == prompt_ref.usage.completion_tokens
    assert prompt_ref.finish_reason == "stop" or prompt_ref.usage.completion_tokens == 16
