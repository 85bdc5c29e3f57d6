"""Tenants and the prompt cache over real processes (router with bearer tokens, prefill, decode): a prompt cached for
one tenant is never a hit, nor a `Usage.cached_tokens` count, for another (the probe that found the leak guessed a
prompt and read 64/76 cached); tenants the router's `--cache-share` groups do share cached prefixes."""

from __future__ import annotations

import json

import grpc
import pytest
from services_testutil import tiny_stack

from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, generate_pb2_grpc

PAGE = 4
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab", "carol": "carol-token-0123456789"}
TOKENS["dave"] = "dave-token-0123456789a"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    work = tmp_path_factory.mktemp("router-tenants")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps({t: name for name, t in TOKENS.items()}))
    extra = ["--auth-tokens-file", str(tokens), "--cache-share", "carol=team", "--cache-share", "dave=team"]
    with tiny_stack(model, work / "stack", kv_dtype="auto", page_size=PAGE, router_extra=extra) as s:
        with channel(s.router) as ch:
            yield generate_pb2_grpc.GenerationStub(ch)


def generate(stub, tenant: str, ids: list[int]) -> tuple[list[int], int]:
    """(completion token ids, cached_tokens) of a greedy request as `tenant`."""
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids), sampling=generate_pb2.SamplingParams(max_tokens=4, temperature=0)
    )
    out = stub.Generate(req, timeout=60, metadata=[("authorization", f"Bearer {TOKENS[tenant]}")])
    return list(out.token_ids), out.usage.cached_tokens


def prompt(seed: int, n: int = 12 * PAGE + 3) -> list[int]:
    return [5 + (seed * 31 + i * 7) % 400 for i in range(n)]


def cold_then_cached(router, tenant: str, ids: list[int]) -> tuple[list[int], int]:
    """`tenant`'s first request of `ids` (nothing cached), then the same until the asynchronous write-back landed
    and it sees its own prompt cached; returns (the tokens, the cached tokens of a full hit)."""
    cold, cached = generate(router, tenant, ids)
    assert cached == 0
    full = (len(ids) - 1) // PAGE * PAGE
    wait_until(lambda: generate(router, tenant, ids)[1] == full, timeout=30, what=f"{tenant}'s prompt cached")
    return cold, full


def test_a_tenants_cached_prompt_is_invisible_to_another(router):
    ids = prompt(1)
    cold, full = cold_then_cached(router, "alice", ids)
    assert generate(router, "bob", ids) == (cold, 0)  # the guess is right, and reveals nothing
    assert generate(router, "carol", ids) == (cold, 0)  # a shared namespace is not alice's either
    assert generate(router, "alice", ids) == (cold, full)


def test_tenants_named_in_cache_share_share_cached_prefixes(router):
    ids = prompt(2)
    cold, full = cold_then_cached(router, "carol", ids)
    assert generate(router, "dave", ids) == (cold, full)  # dave's first request: carol's pages


def test_unknown_and_missing_tokens_are_refused(router):
    req = generate_pb2.GenerateRequest(prompt="hi")
    for metadata, code in (
        ([], grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "Bearer not-a-known-token-000")], grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as err:
            router.Generate(req, timeout=10, metadata=metadata)
        assert err.value.code() == code
