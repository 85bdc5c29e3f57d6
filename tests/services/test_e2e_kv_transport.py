"""Each KV transport forced end to end through real processes (grpc-shm: with both ends' shipper processes):
outputs token-identical to HF (unquantized KV), the forced transport really carried the bytes (Stats counters of
both ends), pools empty afterwards."""

from __future__ import annotations

import pytest
import torch
from services_testutil import tiny_stack

import pdserve
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy
from pdserve.v1 import internal_pb2, internal_pb2_grpc

PAGE, CHUNK = 4, 8
LENGTHS = [1, PAGE + 1, 3 * CHUNK + 5, 61]


def transports(addr: str, stub_cls) -> tuple[dict, tuple[int, int]]:
    with channel(addr) as ch:
        s = stub_cls(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
    return {t.transport: t for t in s.kv_transports}, (s.kv_pages_free, s.kv_pages_total)


@pytest.mark.parametrize("transport", ["grpc", "cuda-ipc", "grpc-shm"])
def test_forced_transport_token_identical_and_taken(transport, model_dir, hf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PREFILL_KV_BATCH_MB", "0.001")  # grpc: one page per message
    extra = ["--kv-transport", transport]
    with tiny_stack(
        model_dir, tmp_path / "stack", kv_dtype="auto", page_size=PAGE, chunk_size=CHUNK, extra=extra
    ) as stack:
        with pdserve.Client(stack.router, timeout=120) as c:
            for n in LENGTHS:
                ids = torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                out = c.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
                assert out.token_ids == hf_greedy(hf_model, ids, 8), f"{transport}, prompt length {n}"
        sent, (free_p, total_p) = transports(stack.prefill[0], internal_pb2_grpc.PrefillStub)
        got, _ = transports(stack.decode[0], internal_pb2_grpc.DecodeStub)
        pages = sum(-(-n // PAGE) for n in LENGTHS)
        for side in (sent, got):
            assert set(side) == {transport}, side  # the forced path, and nothing else, carried the pages
            c = side[transport]
            assert c.requests == len(LENGTHS) and c.pages == pages and c.bytes > 0 and c.fallbacks == 0
            assert c.transfer_seconds > 0
        assert sent[transport].bytes == got[transport].bytes
        if transport == "grpc":  # --kv-batch-mb 0.001: one page per message
            assert sent[transport].batches == pages
        assert free_p == total_p
