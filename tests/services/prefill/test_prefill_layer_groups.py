"""Layer groups through real processes (`--kv-layer-group`): a prefill service ships each chunk's pages layer group by
layer group to a decode that accepts them (in layer order, page by page, every page's layers once), whole chunks to
one that does not, and the groups carry the very bytes of the whole pages (int8 and unquantized). End to end over
grpc and cuda-ipc, outputs are token-identical to HF with unquantized KV and every pool is empty afterwards."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest
import torch
from services_testutil import running_service, stack_pools_empty, tiny_stack

import pdserve
from pdserve.engine.loader import model_fingerprint
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import BatchExpectation, header_layers, verify_header
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PAGE, CHUNK = 4, 8


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    work = tmp_path_factory.mktemp("prefill-layers")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)  # 2 layers: groups of one
    args = ["--model", str(model), "--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages", "200"]
    with running_service("prefill", [*args, "--kv-layer-group", "1", "--torch-threads", "1"], work) as addr:
        with channel(addr) as ch:
            yield internal_pb2_grpc.PrefillStub(ch), model_fingerprint(str(model))


def layout(dtype: str) -> KVLayoutSpec:
    g = 16 if dtype == "int8" else 0
    return KVLayoutSpec(dtype=dtype, page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=16, group_size=g)


def run(stub, fp: str, rid: str, n: int, dtype: str, groups: bool) -> tuple[list, dict[int, bytes], Any]:
    """One Prefill stream acked as it goes: ([(first seq, pages, layer range)] per batch, page -> its whole row
    bytes (groups put side by side per page), PrefillDone)."""
    lay = layout(dtype)
    acks: queue.Queue = queue.Queue()
    req = internal_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=[5 + (7 * i) % 400 for i in range(n)],
        sampling=generate_pb2.SamplingParams(temperature=0),
        kv_layout=lay.to_proto(),
        model_fingerprint=fp,
        kv_layer_groups=groups,
    )

    def client():
        yield internal_pb2.PrefillClientMessage(request=req)
        while (item := acks.get()) is not None:
            yield item

    batches, parts, done = [], {}, None
    try:
        for msg in stub.Prefill(client(), timeout=60):
            if msg.HasField("batch"):
                h, payload = msg.batch.header, msg.batch.payload
                verify_header(h, BatchExpectation(lay, fp, rid), payload)
                r = header_layers(h, lay)
                batches.append((h.first_seq_no, list(h.page_indexes), (r.start, r.stop)))
                fmt = PageFormat(lay, r.count)
                rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(-1, fmt.page_bytes)
                for p, row in zip(h.page_indexes, rows):
                    parts.setdefault(p, []).append((r.start, fmt.unpack(row[None])))
                acks.put(
                    internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=h.first_seq_no + len(rows) - 1))
                )
            elif msg.HasField("done"):
                done = msg.done
    finally:
        acks.put(None)
    assert done is not None
    whole = {}
    for p, pieces in parts.items():  # each segment (data, scales, zeros) concatenated along the layer axis
        segs = [
            torch.cat([s[i] for _, s in sorted(pieces, key=lambda x: x[0])], dim=2)
            for i in range(2)
            if pieces[0][1][i] is not None
        ]
        whole[p] = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in segs)
    return batches, whole, done


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_groups_leave_in_layer_order_with_the_whole_pages_bytes(prefill, dtype):
    stub, fp = prefill
    n = 2 * CHUNK + 3  # three chunks, the last page partial
    grouped, rows, done = run(stub, fp, f"g-{dtype}", n, dtype, groups=True)
    old, whole_rows, whole_done = run(stub, fp, f"w-{dtype}", n, dtype, groups=False)
    shipments, whole_shipments = done.num_pages, whole_done.num_pages
    pages = -(-n // PAGE)
    assert all(r == (0, 2) for _, _, r in old) and whole_shipments == pages  # an older decode: whole chunks
    assert shipments == 2 * pages and [s for s, _, _ in grouped] == [
        sum(len(b[1]) for b in grouped[:i]) for i in range(len(grouped))
    ]
    chunk_pages = [list(range(0, 2)), list(range(2, 4)), list(range(4, pages))]
    want = [(p, r) for c in chunk_pages for r in [(0, 1), (1, 2)] for p in [c]]
    assert [(b[1], b[2]) for b in grouped] == want  # per chunk: layer 0 of its pages, then layer 1
    assert rows == whole_rows  # bit-identical to whole-chunk shipping


@pytest.fixture(scope="module")
def prefill_cache_only(tmp_path_factory):
    """Layer groups of one layer, prompt prefixes from the prompt cache only (not the pool's)."""
    work = tmp_path_factory.mktemp("prefill-layers-cache")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    args = ["--model", str(model), "--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages", "200"]
    args += ["--kv-layer-group", "1", "--prefix-reuse", "false", "--torch-threads", "1"]
    with running_service("prefill", args, work) as addr, channel(addr) as ch:
        yield internal_pb2_grpc.PrefillStub(ch), model_fingerprint(str(model))


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_pages_streamed_in_groups_reach_the_prompt_cache(prefill_cache_only, dtype):
    """The write-back joins a chunk's layer groups into whole pages: the next request for the prompt gets every full
    page before its last token from the cache, with the bytes the groups carried."""
    stub, fp = prefill_cache_only
    n = 2 * CHUNK + 3
    _, computed, done = run(stub, fp, f"c-{dtype}", n, dtype, groups=True)
    assert done.cached_tokens == 0
    want = (n - 1) // PAGE * PAGE
    for attempt in range(50):  # the write-back runs after PrefillDone
        batches, again, done = run(stub, fp, f"c-{dtype}.{attempt}", n, dtype, groups=True)
        if done.cached_tokens == want:
            break
        time.sleep(0.1)
    assert done.cached_tokens == want, "the prompt cache never held the prefix streamed in layer groups"
    cached = range(want // PAGE)  # (the last page is computed again, on the cached prefix: int8's differs)
    assert [again[p] for p in cached] == [computed[p] for p in cached] and len(again) == len(computed)
    assert [r for _, _, r in batches[:1]] == [(0, 2)]  # the cached prefix ships whole, as stored


@pytest.mark.parametrize("transport", ["grpc", "grpc-shm"])  # cuda-ipc's: tests/shared/kv/transfer/test_layer_groups.py
def test_layer_groups_end_to_end_token_identical(transport, model_dir, hf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PREFILL_KV_LAYER_GROUP", "1")  # the tiny model's 2 layers: two groups per chunk
    lengths = [1, PAGE + 1, 3 * CHUNK + 5]
    with tiny_stack(
        model_dir,
        tmp_path / "stack",
        kv_dtype="auto",
        page_size=PAGE,
        chunk_size=CHUNK,
        extra=["--kv-transport", transport],
    ) as stack:
        with pdserve.Client(stack.router, timeout=120) as c:
            for n in lengths:
                ids = torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                out = c.generate(token_ids=ids, max_tokens=6, temperature=0, ignore_eos=True)
                assert out.token_ids == hf_greedy(hf_model, ids, 6), f"{transport}, prompt length {n}"
        with channel(stack.prefill[0]) as ch:
            sent = {
                t.transport: t
                for t in internal_pb2_grpc.PrefillStub(ch).Stats(internal_pb2.StatsRequest()).kv_transports
            }
        pages = sum(-(-n // PAGE) for n in lengths)
        assert sent[transport].pages == pages and sent[transport].batches >= 2 * len(lengths)  # groups, not chunks
        assert stack_pools_empty(stack)
