"""The model's generation_config.json as the default of every request, through the real stack (router + prefill +
decode processes, and the OpenAI gateway): a request that sets no sampling field follows it (here top_k 1, so
greedy: HF's argmax chain), a field the request sets wins over it while the fields it leaves unset still come from
the model, and the file's eos_token_id ends generation."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch
from services_testutil import tiny_stack

import pdserve
from pdserve.engine.sampling import SamplingParams, make_generator, sample
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.hf_reference import hf_greedy, load_hf_model

PROMPT = [5, 17, 99, 23, 8, 250, 31, 77, 12, 400, 3]
N = 12
MODEL_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 1, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint dir, HF model, greedy continuation of PROMPT, index of the token made an EOS id). The
    generation_config.json gets MODEL_SAMPLING and, as an extra EOS id, a token of the greedy continuation that
    first shows at position >= 2 (so a request that stops there is told apart from one that ignores it)."""
    d = build_checkpoint(tmp_path_factory.mktemp("gen-defaults") / "ckpt", arch="llama", seed=6)
    hf = load_hf_model(d)
    greedy = hf_greedy(hf, PROMPT, N)
    cfg_path = d / "generation_config.json"
    cfg = json.loads(cfg_path.read_text())
    config_eos = cfg.get("eos_token_id")
    at = next(i for i in range(2, N) if greedy[i] not in greedy[:i] and greedy[i] != config_eos)
    assert config_eos not in greedy[: at + 1]
    cfg.update(MODEL_SAMPLING, eos_token_id=[config_eos, greedy[at]])
    cfg_path.write_text(json.dumps(cfg))
    return d, hf, greedy, at


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    with tiny_stack(
        model[0], tmp_path_factory.mktemp("gen-defaults-stack"), kv_dtype="auto", extra=["--dtype", "float32"],
        gateway_port=0, model_name="tiny",
    ) as s:  # fmt: skip
        yield s


@torch.no_grad()
def hf_sampled(hf, ids: list[int], n: int, params: SamplingParams) -> list[int]:
    """The engine's sampler (one generator seeded with the request's seed, one draw per token) over HF's logits:
    what a seeded request with `params` generates."""
    gen = make_generator(params.seed, torch.device("cpu"))
    out: list[int] = []
    for _ in range(n):
        logits = hf(torch.tensor([ids + out])).logits[0, -1].float()
        out.append(sample(logits, params, gen))
    return out


def test_a_request_without_sampling_fields_follows_the_model(model, stack):
    _, _, greedy, _ = model
    with pdserve.Client(stack.router, timeout=60) as c:
        out = c.generate(token_ids=PROMPT, max_tokens=N, ignore_eos=True)  # model: top_k 1 -> argmax
        streamed = [t for ch in c.stream(token_ids=PROMPT, max_tokens=N, ignore_eos=True) for t in ch.token_ids]
    assert out.token_ids == streamed == greedy


def test_explicit_fields_win_and_unset_ones_stay_the_models(model, stack):
    """top_k 0 and temperature 1.0 sent: sampled (no longer argmax); top_p unset: the model's 0.8 applies."""
    _, hf, greedy, _ = model
    top_p = float(np.float32(MODEL_SAMPLING["top_p"]))  # as the wire's float carries it

    for seed in range(50):  # a seed whose draw differs from the greedy chain and depends on top_p: both show
        want, unfiltered = (
            hf_sampled(hf, PROMPT, N, SamplingParams(temperature=1.0, top_k=0, top_p=p, seed=seed))
            for p in (top_p, 1.0)  # the model's top_p (unset in the request), top_p 1.0 sent
        )
        if len({tuple(want), tuple(unfiltered), tuple(greedy)}) == 3:
            break
    else:
        pytest.fail("no seed in 0..49 draws differently with top_p 0.8, 1.0 and greedy")
    with pdserve.Client(stack.router, timeout=60) as c:
        out = c.generate(token_ids=PROMPT, max_tokens=N, ignore_eos=True, temperature=1.0, top_k=0, seed=seed)
        explicit_greedy = c.generate(token_ids=PROMPT, max_tokens=N, ignore_eos=True, temperature=0.0, top_k=0)
        explicit_top_p = c.generate(
            token_ids=PROMPT, max_tokens=N, ignore_eos=True, temperature=1.0, top_k=0, top_p=1.0, seed=seed
        )
    assert out.token_ids == want != greedy
    assert explicit_greedy.token_ids == greedy  # temperature 0 sent: greedy, even with top_k 0 sent too
    assert explicit_top_p.token_ids == unfiltered


def test_the_models_eos_ids_end_generation(model, stack):
    _, _, greedy, at = model
    with pdserve.Client(stack.router, timeout=60) as c:
        out = c.generate(token_ids=PROMPT, max_tokens=N)
    assert out.finish_reason == "stop" and out.token_ids == greedy[: at + 1]


def test_the_gateway_and_the_sdk_get_the_same_defaults(model, stack):
    """An OpenAI request with no sampling parameter: the model's defaults (greedy here), as the SDK's."""
    _, _, greedy, at = model
    client = openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="none", max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N)
    with pdserve.Client(stack.router, timeout=60) as c:
        ref = c.generate(token_ids=PROMPT, max_tokens=N)
    assert ref.token_ids == greedy[: at + 1]
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
