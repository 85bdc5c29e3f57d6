"""End to end through three real processes (router, prefill, decode) over gRPC."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy, load_hf_model
from pdserve.v1 import internal_pb2, internal_pb2_grpc

PAGE, CHUNK = 4, 8
# Prompt lengths at page and chunk edges, length 1 and a prompt spanning several chunks.
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("e2e-llama") / "ckpt", arch="llama", seed=1)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf_model(model_dir)


def prompts(n_tokens: int, vocab: int = 512, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + n_tokens)
    return torch.randint(5, vocab, (n_tokens,), generator=g).tolist()


def pool_usage(stack) -> list[tuple[int, int]]:
    """(free, total) KV pages of every prefill and decode instance."""
    out = []
    for addr in stack.prefill:
        with channel(addr) as ch:
            s = internal_pb2_grpc.PrefillStub(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
            out.append((s.kv_pages_free, s.kv_pages_total))
    for addr in stack.decode:
        with channel(addr) as ch:
            s = internal_pb2_grpc.DecodeStub(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
            out.append((s.kv_pages_free, s.kv_pages_total))
    return out


def wait_pools_empty(stack, timeout: float = 10.0) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout
    while True:
        usage = pool_usage(stack)
        if all(free == total for free, total in usage) or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


@pytest.fixture(scope="module")
def auto_stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("stack-auto")
    with tiny_stack(model_dir, work, kv_dtype="auto", page_size=PAGE, chunk_size=CHUNK, num_pages=512) as stack:
        yield stack


@pytest.fixture(scope="module")
def int8_stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("stack-int8")
    with tiny_stack(model_dir, work, kv_dtype="int8", page_size=PAGE, chunk_size=CHUNK, num_pages=512) as stack:
        yield stack


@pytest.fixture(scope="module")
def fp8_stack(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("stack-fp8")
    with tiny_stack(model_dir, work, kv_dtype="fp8", page_size=PAGE, chunk_size=CHUNK, num_pages=512) as stack:
        yield stack


def test_auto_kv_token_identical_to_hf(auto_stack, hf_model):
    with pdserve.Client(auto_stack.router, timeout=120) as c:
        for n in LENGTHS:
            ids = prompts(n)
            out = c.generate(token_ids=ids, max_tokens=12, temperature=0, ignore_eos=True)
            assert out.token_ids == hf_greedy(hf_model, ids, 12), f"prompt length {n}"
            assert out.finish_reason == "length"
            assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 12
    assert wait_pools_empty(auto_stack) == [(t, t) for _, t in pool_usage(auto_stack)]


def test_concurrent_requests_match_hf(auto_stack, hf_model):
    """Requests that overlap in the decode batch (joining and leaving between steps) stay exact."""
    from concurrent.futures import ThreadPoolExecutor

    lens = [3, 9, 17, 30, 5, 12]
    with pdserve.Client(auto_stack.router, timeout=120) as c, ThreadPoolExecutor(len(lens)) as ex:
        futs = [
            ex.submit(c.generate, token_ids=prompts(n, seed=2), max_tokens=8 + i, temperature=0, ignore_eos=True)
            for i, n in enumerate(lens)
        ]
        for i, (n, f) in enumerate(zip(lens, futs)):
            assert f.result().token_ids == hf_greedy(hf_model, prompts(n, seed=2), 8 + i)


def test_stream_text_and_first_chunk(auto_stack):
    with pdserve.Client(auto_stack.router, timeout=60) as c:
        chunks = list(c.stream("The assert statement", max_tokens=10, temperature=0, ignore_eos=True))
        full = c.generate("The assert statement", max_tokens=10, temperature=0, ignore_eos=True)
    assert chunks[0].ttft_ms is not None and chunks[0].ttft_ms > 0
    assert len(chunks[0].token_ids) == 1  # the first token is sent as soon as it exists
    assert [t for ch in chunks for t in ch.token_ids] == full.token_ids
    assert "".join(ch.text for ch in chunks) == full.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10


def test_stop_string_and_stop_token(auto_stack):
    with pdserve.Client(auto_stack.router, timeout=60) as c:
        ref = c.generate("Assert statements are", max_tokens=20, temperature=0, ignore_eos=True)
        assert len(ref.text) > 4
        stop = ref.text[2:4]
        out = c.generate("Assert statements are", max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
        assert out.finish_reason == "stop" and stop not in out.text
        assert ref.text.startswith(out.text)
        tok = ref.token_ids[3]
        out = c.generate("Assert statements are", max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[tok])
        assert out.finish_reason == "stop" and out.token_ids[-1] == tok
        assert out.token_ids == ref.token_ids[: ref.token_ids.index(tok) + 1]


def test_seeded_sampling_reproducible(auto_stack):
    with pdserve.Client(auto_stack.router, timeout=60) as c:
        a = c.generate("Sampling", max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
        b = c.generate("Sampling", max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(token_ids=[5 + i % 500 for i in range(1200)]), "context"),
        (dict(prompt="assert statement " * 1500), "context"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=-3), "max_tokens"),
        (dict(prompt="hi", temperature=-0.5), "temperature"),
        (dict(prompt="hi", top_p=0.0), "top_p"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(token_ids=[5, 99999]), "vocabulary"),
    ],
)
def test_bad_input_invalid_argument(auto_stack, kwargs, reason):
    with pdserve.Client(auto_stack.router, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(**kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()


def test_cancel_mid_stream_frees_every_page(auto_stack):
    with pdserve.Client(auto_stack.router, timeout=60) as c:
        stream = c.stream(token_ids=prompts(3 * CHUNK + 5), max_tokens=500, temperature=0, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # cancels the RPC
        usage = wait_pools_empty(auto_stack)
    assert all(free == total for free, total in usage), usage


def test_cancel_during_prefill_frees_every_page(auto_stack):
    """Cancel while prefill is still running (long prompt, tiny deadline)."""
    with pdserve.Client(auto_stack.router) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=prompts(900), max_tokens=50, timeout=0.05)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    usage = wait_pools_empty(auto_stack)
    assert all(free == total for free, total in usage), usage


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_end_to_end(kv, auto_stack, request):
    """int8 / fp8 KV pages through the real P→D path: greedy agreement with unquantized KV, measured."""
    quant_stack = request.getfixturevalue(f"{kv}_stack")
    agree = total = 0
    first_diff = []
    with pdserve.Client(quant_stack.router, timeout=120) as q, pdserve.Client(auto_stack.router, timeout=120) as a:
        for n in LENGTHS:
            ids = prompts(n, seed=3)
            ref = a.generate(token_ids=ids, max_tokens=16, temperature=0, ignore_eos=True).token_ids
            got = q.generate(token_ids=ids, max_tokens=16, temperature=0, ignore_eos=True).token_ids
            same = [x == y for x, y in zip(ref, got)]
            first_diff.append(same.index(False) if False in same else len(same))
            agree += sum(same)
            total += len(same)
    print(f"{kv} vs auto greedy token agreement {agree}/{total}, first divergence per prompt {first_diff}")
    # Random-weight model: a divergence compounds; the first token (prefill exact) must always agree.
    assert min(first_diff) >= 1
    assert agree / total >= 0.6
    usage = wait_pools_empty(quant_stack)
    assert all(free == total for free, total in usage), usage


def test_health_and_reflection(auto_stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for addr in [auto_stack.router, *auto_stack.prefill, *auto_stack.decode]:
        with channel(addr) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            names = [
                s.name
                for r in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([req]), timeout=5)
                for s in r.list_services_response.service
            ]
            assert "grpc.health.v1.Health" in names and any(n.startswith("pdserve.v1.") for n in names)
