"""Two models behind one router, through the real stack (router, a prefill and a decode process per model, the
OpenAI gateway): the second model's instances register under its name; a request naming a model gets exactly
that model's greedy output (HF's), its prompt tokenized with that model's tokenizer; ListModels and /v1/models
list both; a request naming none is INVALID_ARGUMENT / 400 naming the choices, an unknown one NOT_FOUND / 404;
every prefill/decode pair the router uses is of one model (the registry's listing)."""

from __future__ import annotations

import urllib.request

import grpc
import openai
import pytest
from router_testutil import instances
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.router.tokenizer import load_tokenizer
from pdserve.testing.hf_reference import hf_greedy, load_hf_model

PROMPT = [5, 17, 99, 23, 8, 250, 31, 77, 12, 400, 3]
TEXT = "The assert statement"
N = 10
ALPHA, BETA = "alpha", "beta"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two checkpoints of different architectures and vocabularies: {name: (dir, HF model)}."""
    base = tmp_path_factory.mktemp("multi-model")
    dirs = {
        ALPHA: build_checkpoint(base / ALPHA, arch="llama", seed=21),
        BETA: build_checkpoint(base / BETA, arch="qwen2", seed=22, vocab_size=448),
    }
    return {name: (d, load_hf_model(d)) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    with tiny_stack(
        models[ALPHA][0], tmp_path_factory.mktemp("multi-model-stack"), kv_dtype="auto", extra=["--dtype", "float32"],
        gateway_port=0, model_name=ALPHA, more_models=[(BETA, str(models[BETA][0]))],
    ) as s:  # fmt: skip
        yield s


def test_both_models_are_listed(stack):
    with pdserve.Client(stack.router, timeout=30) as c:
        assert c.list_models() == [ALPHA, BETA]
    listed = instances(stack.router)
    assert {i.model for i in listed.values()} == {ALPHA, BETA}
    for addr in stack.models[BETA]:
        assert listed[addr].model == BETA and listed[addr].registered
    for addr in [*stack.prefill, *stack.decode]:
        assert listed[addr].model == ALPHA
    text = urllib.request.urlopen(f"http://{stack.router.metrics}/metrics", timeout=10).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("pdserve_instance_model{")]
    for addr in stack.models[BETA]:
        assert any(f'address="{addr}"' in ln and 'model="beta"' in ln for ln in lines), lines
    assert 'pdserve_model_queue_depth{model="alpha"}' in text


def test_each_model_gives_its_own_greedy_output(models, stack):
    want = {name: hf_greedy(hf, PROMPT, N) for name, (_, hf) in models.items()}
    assert want[ALPHA] != want[BETA]  # the two models tell apart
    with pdserve.Client(stack.router, timeout=60) as c:
        for name in (ALPHA, BETA, BETA, ALPHA):
            out = c.generate(token_ids=PROMPT, max_tokens=N, temperature=0, ignore_eos=True, model=name)
            assert out.token_ids == want[name], name
            streamed = c.stream(token_ids=PROMPT, max_tokens=N, temperature=0, ignore_eos=True, model=name)
            assert [t for ch in streamed for t in ch.token_ids] == want[name], name
    # every pair ran within its model: both models' prefill and decode instances served requests
    listed = instances(stack.router)
    used = {(i.model, i.role) for i in listed.values() if i.assigned}
    assert len(used) == 4, used


def test_a_text_prompt_uses_its_models_tokenizer(models, stack):
    d, hf = models[BETA]
    ids = list(load_tokenizer(d)(TEXT).input_ids)
    with pdserve.Client(stack.router, timeout=60) as c:
        out = c.generate(prompt=TEXT, max_tokens=N, temperature=0, ignore_eos=True, model=BETA)
    assert out.usage.prompt_tokens == len(ids) and out.token_ids == hf_greedy(hf, ids, N)


def test_no_model_or_an_unknown_one_is_refused_by_name(stack):
    with pdserve.Client(stack.router, timeout=30, retry=False) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=PROMPT, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'alpha'" in e.value.details() and "'beta'" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=PROMPT, max_tokens=2, model="gamma")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'gamma'" in e.value.details()


def test_the_gateway_serves_both(models, stack):
    client = openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [ALPHA, BETA]
    for name, (_, hf) in models.items():
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=N, temperature=0)
        with pdserve.Client(stack.router, timeout=60) as c:
            ref = c.generate(token_ids=PROMPT, max_tokens=N, temperature=0, model=name)
        assert out.model == name and out.choices[0].text == ref.text
        assert ref.token_ids == hf_greedy(hf, PROMPT, len(ref.token_ids))
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gamma", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    assert "'gamma'" in info.value.body["message"] and "'beta'" in info.value.body["message"]
