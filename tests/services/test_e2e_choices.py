"""n > 1 and best_of through the real CPU stack (router, prefill, decode and the OpenAI gateway, over gRPC / HTTP):
the prompt is prefilled and its KV shipped once (the instances' transfer counters), decode forks the choices; the
`openai` client drives n through the gateway."""

from __future__ import annotations

import grpc
import openai
import pytest
from services_testutil import prompts, stack_pools_empty, tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.wait import wait_until
from pdserve.v1 import internal_pb2, internal_pb2_grpc

PAGE = 4
MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = build_checkpoint(tmp_path_factory.mktemp("choices-llama") / "ckpt", arch="llama", seed=3)
    work = tmp_path_factory.mktemp("choices-stack")
    with tiny_stack(model, work, kv_dtype="auto", page_size=PAGE, gateway_port=0, model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(stack):
    with pdserve.Client(stack.router, timeout=120) as c:
        yield c


def kv_pages(addr: str, stub) -> int:
    """Pages the instance at `addr` shipped (prefill) or received (decode) so far, every transport (its Stats)."""
    with channel(addr) as ch:
        stats = stub(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
    return sum(t.pages for t in stats.kv_transports)


def test_n4_greedy_identical_and_kv_shipped_once(stack, sdk):
    ids = prompts(10)  # 3 pages
    one = sdk.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
    sent0 = kv_pages(stack.prefill[0], internal_pb2_grpc.PrefillStub)
    got0 = kv_pages(stack.decode[0], internal_pb2_grpc.DecodeStub)
    four = sdk.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True, n=4)
    assert kv_pages(stack.prefill[0], internal_pb2_grpc.PrefillStub) - sent0 == 3  # one prompt's pages
    assert kv_pages(stack.decode[0], internal_pb2_grpc.DecodeStub) - got0 == 3
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert all(c.token_ids == one.token_ids and c.text == one.text for c in four.choices)
    assert all(c.finish_reason == "length" and c.usage.completion_tokens == 8 for c in four.choices)
    assert four.token_ids == one.token_ids and four.index == 0  # the top level is choice 0
    assert (four.usage.prompt_tokens, four.usage.completion_tokens) == (10, 32)  # the prompt once, every choice
    wait_until(lambda: stack_pools_empty(stack), what="every KV pool empty")


def test_seeded_n3_reproducible_and_streamed_alike(sdk):
    kw = dict(token_ids=prompts(7, seed=1), max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, n=3)
    a, b = sdk.generate(**kw), sdk.generate(**kw)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) > 1  # each choice its own generator
    streamed: dict[int, list[int]] = {}
    finishes: list[int] = []
    chunks = list(sdk.stream(**kw))
    for ch in chunks:
        streamed.setdefault(ch.index, []).extend(ch.token_ids)
        if ch.finish_reason is not None:
            finishes.append(ch.index)
    assert sorted(finishes) == [0, 1, 2]
    assert streamed == {c.index: c.token_ids for c in a.choices}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (7, 30)


def test_best_of_returns_the_highest_logprob_candidate(sdk):
    kw = dict(token_ids=prompts(6, seed=2), max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    cands = sdk.generate(**kw, n=3, logprobs=True).choices
    scores = [sum(lp.logprob for lp in c.logprobs or []) for c in cands]
    best = max(range(3), key=lambda i: (scores[i], -i))
    out = sdk.generate(**kw, best_of=3)
    assert out.token_ids == cands[best].token_ids and not out.choices
    assert out.usage.completion_tokens == 18  # every candidate's tokens, as OpenAI bills best_of
    for bad in (dict(n=17), dict(n=2, best_of=1), dict(best_of=17)):
        with pytest.raises(grpc.RpcError) as e:
            sdk.generate(**kw, **bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        list(sdk.stream(**kw, best_of=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "best_of" in e.value.details()


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_n2(stack, sdk, oai):
    ref = sdk.generate(prompt="The assert statement", max_tokens=6, temperature=0, n=2)
    out = oai.completions.create(model=MODEL, prompt="The assert statement", max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [c.text for c in ref.choices]
    assert out.usage.completion_tokens == ref.usage.completion_tokens == 12
    texts: dict[int, str] = {}
    finished = []
    stream = oai.completions.create(
        model=MODEL, prompt="The assert statement", max_tokens=6, temperature=0, n=2, stream=True
    )
    for ev in stream:
        for c in ev.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(finished) == [0, 1] and texts == {0: ref.choices[0].text, 1: ref.choices[1].text}

    chat = [{"role": "user", "content": "What does assert do?"}]
    ref = sdk.chat(chat, max_tokens=5, temperature=1.0, seed=3, n=2)
    got = oai.chat.completions.create(model=MODEL, messages=chat, max_tokens=5, temperature=1.0, seed=3, n=2)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.message.content for c in got.choices] == [c.text for c in ref.choices]
    deltas: dict[int, str] = {}
    stream = oai.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=5, temperature=1.0, seed=3, n=2, stream=True
    )
    for ev in stream:
        for c in ev.choices:
            deltas[c.index] = deltas.get(c.index, "") + (c.delta.content or "")
    assert deltas == {0: ref.choices[0].text, 1: ref.choices[1].text}
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, n=1, best_of=2, stream=True)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, n=17)
    best = oai.completions.create(model=MODEL, prompt="x", max_tokens=3, n=1, best_of=2, seed=1, temperature=1.0)
    assert len(best.choices) == 1
    wait_until(lambda: stack_pools_empty(stack), what="every KV pool empty")


def test_gpu_bench_choices_part_runs_on_cpu(stack):
    """bench/gpu_serving.py's `choices` part on this stack, tiny: its keys, and n = 4 shipping a quarter of the KV."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_serving import choices_figures

    got = choices_figures(stack, torch.Generator().manual_seed(0), prompts=2, prompt_len=8, out=3, vocab=512)
    assert got["n4_out_tok_s"] > 0 and got["n1x4_out_tok_s"] > 0
    assert got["n1x4_kv_bytes_per_prompt"] == 4 * got["n4_kv_bytes_per_prompt"] > 0
