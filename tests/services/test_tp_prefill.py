"""Tensor-parallel prefill through the real services (issue 31): prefill instances at `--tensor-parallel-size` 1 and
2, decode instances at 1 and 2 (a 6-head model over 2 KV heads: each TP=2 rank holds one KV head), the prefill
instances sharing a private redis-server as their prompt cache. Requests go to a decode instance with an explicit
prefill target, so every pair is exercised: each prefill rank gathers its heads, rank 0 ships pages of every KV head,
each decode rank keeps its own. The TP=2 prefill streams layer groups (every rank's forward gathers each group as
its last layer is written), whole pages for the prompt cache.

- fp32, full-precision KV (kv_dtype auto): prefill TP=2 -> decode TP=1, TP=1 -> TP=2 and TP=2 -> TP=2 give the
  greedy tokens of TP=1 -> TP=1, which equal HF's.
- The prompt cache stores pages of every KV head: a prefix written by the TP=2 prefill is a hit for the TP=1 one with
  the same tokens, and the other way round.
- The same over the cuda-ipc transport (a shared-memory staging buffer on CPU) from the TP=2 prefill.
- The handshake carries each side's split of the KV heads: a decode claiming a split this model does not have at its
  TP size is refused with FAILED_PRECONDITION before anything is computed.
(int8 pages bit for bit whatever the TP sizes: tests/shared/engine/tp/test_tp_page_export.py.)
"""

from __future__ import annotations

import time
import uuid

import grpc
import psutil
import pytest
from services_testutil import prompts, services

from pdserve.cache.value_auth import write_secret_file
from pdserve.engine.loader import model_fingerprint
from pdserve.kv.codec import KVLayoutSpec
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy, load_hf_model
from pdserve.testing.redis_server import RedisServer
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc, kv_pb2

pytestmark = pytest.mark.timeout(400)
PAGE = 4
FLAGS = ["--torch-threads", "1", "--page-size", str(PAGE), "--chunk-size", "8", "--num-pages", "256"]
FLAGS += ["--kv-dtype", "auto"]
TP_SIZES = (1, 2)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    return build_checkpoint(tmp_path_factory.mktemp("tp-prefill-model") / "ckpt", arch="llama", seed=7, **shape)


@pytest.fixture(scope="module")
def stack(tp_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp-prefill")
    redis = RedisServer(work / "redis").start()
    cache = ["--redis-url", redis.url, "--cache-secret-file", str(write_secret_file(work / "secret"))]
    cache += ["--cache-local-mb", "0", "--prefix-reuse", "false"]  # hits come from Redis, never from the pool
    try:
        with services(work, ["--model", str(tp_model)]) as group:
            tp = [["--tensor-parallel-size", str(n)] for n in TP_SIZES]
            # the TP=2 prefill streams each chunk in layer groups of 1 (its ranks gather them inside the forward);
            # the TP=1 one ships whole chunks (the default group covers both layers)
            groups = [[], ["--kv-layer-group", "1"]]
            specs = [("prefill", [*FLAGS, *cache, *t, *g]) for t, g in zip(tp, groups)]
            specs += [("decode", [*FLAGS, *t]) for t in tp]
            specs.append(("decode", [*FLAGS, "--kv-transport", "cuda-ipc"]))  # shared memory on CPU
            addrs = [str(a) for a in group.start(specs)]
            for addr, n in zip(addrs, TP_SIZES * 2):  # rank 0 started the other ranks
                assert len(psutil.Process(group.procs[addr].pid).children()) == n - 1
            channels = {a: channel(a) for a in addrs}
            try:
                yield dict(prefill=addrs[:2], decode=addrs[2:4], ipc=addrs[4], channels=channels, redis=redis)
            finally:
                for ch in channels.values():
                    ch.close()
    finally:
        redis.stop()


def generate(
    stack, prefill_tp: int, decode_tp: int, ids: list[int], scope: str, ipc: bool = False
) -> tuple[list[int], int]:
    """(greedy completion tokens, cached_tokens) of a request to the decode instance at `decode_tp` (`ipc`: the
    TP=1 one forcing the cuda-ipc transport) with the prefill instance at `prefill_tp` as its target, its pages
    cached in `scope`."""
    req = internal_pb2.DecodeRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=ids,
        prefill_target=stack["prefill"][TP_SIZES.index(prefill_tp)],
        sampling=generate_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        cache_scope=scope,
    )
    decode = stack["ipc"] if ipc else stack["decode"][TP_SIZES.index(decode_tp)]
    stub = internal_pb2_grpc.DecodeStub(stack["channels"][decode])
    tokens, cached = [], None
    for msg in stub.Generate(req, timeout=120):
        tokens += msg.token_ids
        if msg.HasField("usage"):
            cached = msg.usage.cached_tokens
    assert cached is not None
    return tokens, cached


def test_every_tp_pair_is_token_identical_to_tp1(stack, tp_model):
    hf = load_hf_model(tp_model)
    for n in (1, 5, 17, 30):  # within a page, page edges, several chunks
        ids = prompts(n, seed=n)
        want = hf_greedy(hf, ids, 8)
        for pair in ((1, 1), (2, 1), (1, 2), (2, 2)):
            got, cached = generate(stack, *pair, ids, scope=uuid.uuid4().hex)  # a fresh scope: computed
            assert (got, cached) == (want, 0), f"prefill TP={pair[0]} -> decode TP={pair[1]}, prompt length {n}"
        assert generate(stack, 2, 1, ids, scope=uuid.uuid4().hex, ipc=True) == (want, 0), f"cuda-ipc, length {n}"


def grpc_counters(stack, prefill_tp: int) -> tuple[int, int]:
    """(pages, batches) the prefill instance at `prefill_tp` shipped over grpc so far."""
    stub = internal_pb2_grpc.PrefillStub(stack["channels"][stack["prefill"][TP_SIZES.index(prefill_tp)]])
    stats = stub.Stats(internal_pb2.StatsRequest(), timeout=10)
    grpc_stats = [t for t in stats.kv_transports if t.transport == "grpc"]
    return (grpc_stats[0].pages, grpc_stats[0].batches) if grpc_stats else (0, 0)


def test_a_tp_prefill_streams_layer_groups(stack, tp_model):
    """One chunk of 2 pages from the TP=2 prefill (--kv-layer-group 1, a 2-layer model): 2 batches, one per layer
    group, each of both pages (a whole-chunk shipment would be one), with the TP=1 tokens."""
    ids = prompts(8, seed=3)
    before = grpc_counters(stack, 2)
    want, _ = generate(stack, 1, 1, ids, scope=uuid.uuid4().hex)
    assert generate(stack, 2, 1, ids, scope=uuid.uuid4().hex) == (want, 0)
    pages, batches = grpc_counters(stack, 2)
    assert (pages - before[0], batches - before[1]) == (2, 2)


def flush_when_quiet(client) -> None:
    """Empty Redis once earlier requests' asynchronous write-backs landed (no new value for 0.5 s)."""
    deadline, count = time.monotonic() + 10, -1
    while client.dbsize() != count and time.monotonic() < deadline:
        count = client.dbsize()
        time.sleep(0.5)
    client.flushall()


def wait_values(client, n: int, timeout: float = 30.0) -> None:
    """Wait for the asynchronous write-back: `n` page values in Redis."""
    deadline = time.monotonic() + timeout
    while client.dbsize() < n:
        assert time.monotonic() < deadline, f"{client.dbsize()} values in Redis, expected {n}"
        time.sleep(0.02)


@pytest.mark.parametrize(("writer", "reader"), [(2, 1), (1, 2)])
def test_a_prefix_cached_at_one_tp_size_is_a_hit_at_the_other(stack, writer, reader):
    """The writer prefill computes the prompt and writes its full pages to Redis; the reader prefill (the other TP
    size, never saw the prompt) takes them all from there and the tokens are the same, through both decode sizes."""
    ids = prompts(9 * PAGE + 3, seed=40 + writer)
    scope = f"tenant:{uuid.uuid4().hex}"
    client = stack["redis"].client()
    flush_when_quiet(client)
    cold, cached = generate(stack, writer, 1, ids, scope)
    assert cached == 0
    wait_values(client, 9)  # the writer's 9 full pages
    for decode_tp in TP_SIZES:
        assert generate(stack, reader, decode_tp, ids, scope) == (cold, 9 * PAGE), f"decode TP={decode_tp}"
    # cuda-ipc ships a cached prefix from the device copy the reader's import made (its pages of every KV head)
    assert generate(stack, reader, 1, ids, scope, ipc=True) == (cold, 9 * PAGE)


def test_a_decode_split_this_model_does_not_have_is_refused(stack, tp_model):
    """6 query heads over 2 KV heads at TP=2 is one KV head per rank; a decode claiming two is refused."""
    layout = KVLayoutSpec(dtype="float32", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=8)
    req = internal_pb2.PrefillRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompts(6, seed=1),
        sampling=generate_pb2.SamplingParams(temperature=0),
        kv_layout=layout.to_proto(),
        model_fingerprint=model_fingerprint(str(tp_model)),
        kv_transport=kv_pb2.KVTransportOffer(
            transports=["grpc"], shards=kv_pb2.KVShardLayout(tensor_parallel_size=2, kv_heads_per_rank=2)
        ),
    )
    stub = internal_pb2_grpc.PrefillStub(stack["channels"][stack["prefill"][1]])
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Prefill(iter([internal_pb2.PrefillClientMessage(request=req)]), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "this model splits into 1 per rank" in err.value.details()
