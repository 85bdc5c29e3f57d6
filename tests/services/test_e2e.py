"""End to end through three real processes (router, prefill, decode) over gRPC."""

from __future__ import annotations

from contextlib import ExitStack

import grpc
import pytest
from services_testutil import greedy_agreement, prompts, stack_pools_empty, tiny_stack

import pdserve
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.wait import wait_until

PAGE, CHUNK = 4, 8
# Prompt lengths at page and chunk edges, length 1 and a prompt spanning several chunks.
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def wait_pools_empty(stack) -> None:
    wait_until(lambda: stack_pools_empty(stack), what="every KV pool of the stack empty")


@pytest.fixture(scope="module")
def stack_of(model_dir, tmp_path_factory):
    """stack_of(kv_dtype): this module's stack whose KV pools hold `kv_dtype`, started on first use."""
    with ExitStack() as running:
        stacks: dict = {}

        def get(kv_dtype: str):
            if kv_dtype not in stacks:
                work = tmp_path_factory.mktemp(f"stack-{kv_dtype}")
                stacks[kv_dtype] = running.enter_context(
                    tiny_stack(model_dir, work, kv_dtype=kv_dtype, page_size=PAGE, chunk_size=CHUNK, num_pages=512)
                )
            return stacks[kv_dtype]

        yield get


@pytest.fixture(scope="module")
def auto_stack(stack_of):
    return stack_of("auto")


def test_auto_kv_token_identical_to_hf(auto_stack, hf_model):
    with pdserve.Client(auto_stack.router, timeout=120) as c:
        for n in LENGTHS:
            ids = prompts(n)
            out = c.generate(token_ids=ids, max_tokens=12, temperature=0, ignore_eos=True)
            assert out.token_ids == hf_greedy(hf_model, ids, 12), f"prompt length {n}"
            assert out.finish_reason == "length"
            assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 12
    wait_pools_empty(auto_stack)


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
        wait_pools_empty(auto_stack)


def test_cancel_during_prefill_frees_every_page(auto_stack):
    """Cancel while prefill is still running (long prompt, tiny deadline)."""
    with pdserve.Client(auto_stack.router) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=prompts(900), max_tokens=50, timeout=0.05)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_pools_empty(auto_stack)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_end_to_end(kv, auto_stack, stack_of):
    """int8 / fp8 KV pages through the real P→D path: greedy agreement with unquantized KV, measured."""
    quant_stack = stack_of(kv)
    with pdserve.Client(quant_stack.router, timeout=120) as q, pdserve.Client(auto_stack.router, timeout=120) as a:
        agree, total, first_diff = greedy_agreement(a, q, [prompts(n, seed=3) for n in LENGTHS])
    print(f"{kv} vs auto greedy token agreement {agree}/{total}, first divergence per prompt {first_diff}")
    # Random-weight model: a divergence compounds; the first token (prefill exact) must always agree.
    assert min(first_diff) >= 1
    assert agree / total >= 0.6
    wait_pools_empty(quant_stack)


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


def head_starts_taken(stack) -> float:
    """The prefill's `pdserve_head_starts_taken_total` (its /metrics)."""
    from pdserve.testing.scrape import metric_samples

    return metric_samples(stack.prefill[0].metrics).get("pdserve_head_starts_taken_total", 0.0)


@pytest.mark.parametrize("head_start", [True, False])
def test_router_head_start_on_and_off_exact(head_start, model_dir, tmp_path, hf_model):
    """The router's head start (default on): from the prefill's second request on, its prefill begins at the
    router's dispatch and decode's stream takes it over, with HF's tokens at chunk and page edges; off
    (`--prefill-head-start false`) the prefill starts from decode's stream, with the same tokens."""
    router = [] if head_start else ["--prefill-head-start", "false"]
    with tiny_stack(model_dir, tmp_path, kv_dtype="auto", router_extra=router) as stack:
        with pdserve.Client(stack.router, timeout=120) as c:
            for n in [PAGE, CHUNK + 1, 3 * CHUNK + 5]:
                ids = prompts(n, seed=5)
                assert c.generate(token_ids=ids, max_tokens=6, temperature=0, ignore_eos=True).token_ids == hf_greedy(
                    hf_model, ids, 6
                )
        wait_pools_empty(stack)
        assert head_starts_taken(stack) == (2 if head_start else 0)  # the first request told prefill decode's shape
