"""Prefill instances whose Redis pages race the compute (`--cache-fetch-race on`, the GPU default) through real
processes: the pages that land first are loaded and shipped to decode from the pool, the rest computed; the output
equals a cold run's, `cached_tokens` counts the loaded pages, and the write-back stores only what Redis lacked.
The third prefill reads Redis in its fetch helper process (`--cache-fetch-process on`, the GPU default), the
others on threads of their own process (the CPU default)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch

from pdserve.cache.value_auth import write_secret_file
from pdserve.cli.launch import start_service, wait_ready
from pdserve.server.grpc_util import channel
from pdserve.testing.otlp_sink import OTLPSink
from pdserve.testing.redis_server import RedisServer
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PAGE = 4
ENGINE = ["--page-size", str(PAGE), "--chunk-size", "8", "--num-pages", "512", "--torch-threads", "1"]
RACE = ["--cache-fetch-race", "on", "--cache-local-mb", "0", "--prefix-reuse", "false"]
HELPER = ["--cache-fetch-process", "on", "--cache-fetch-arena-mb", "64"]


def children(pid: int) -> list[str]:
    """Command lines of `pid`'s child processes."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += (task / "children").read_text().split()
    return [Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode() for k in kids]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    """(redis client, [prefill addresses], decode address, channels, prefill pids, OTLP sink): three racing prefills
    sharing one Redis, the third with the fetch helper process."""
    work = tmp_path_factory.mktemp("fetch-race")
    redis = RedisServer(work / "redis").start()
    sink = OTLPSink().start()  # the prefill spans' fetch attributes
    env = {"REDIS_URL": redis.url, "PDSERVE_CACHE_SECRET_FILE": str(write_secret_file(work / "secret"))}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    specs = [("prefill", RACE, env), ("prefill", RACE, env), ("prefill", RACE + HELPER, env)]
    specs.append(("decode", ["--kv-dtype", "auto"], {}))
    started = [start_service(n, ["--model", str(model_dir), *ENGINE, *a], work, env=e) for n, a, e in specs]
    try:
        addrs = [wait_ready(*s, timeout=120) for s in started]
        chans = {a: channel(a) for a in addrs}
        yield redis.client(), addrs[:3], addrs[3], chans, [s[0].pid for s in started[:3]], sink
        for ch in chans.values():
            ch.close()
    finally:
        for s in started:
            s[0].terminate()
        for s in started:
            s[0].wait(20)
        redis.stop()
        sink.stop()


def generate(stack, prefill: int, ids: list[int]) -> tuple[list[int], int]:
    _, prefills, decode, chans, _, _ = stack
    req = internal_pb2.DecodeRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=ids,
        prefill_target=prefills[prefill],
        sampling=generate_pb2.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )
    tokens, cached = [], None
    for msg in internal_pb2_grpc.DecodeStub(chans[decode]).Generate(req, timeout=60):
        tokens += msg.token_ids
        if msg.HasField("usage"):
            cached = msg.usage.cached_tokens
    assert cached is not None
    return tokens, cached


def test_racing_hits_output_identical_and_counted(stack):
    rds = stack[0]
    ids = torch.randint(5, 512, (11 * PAGE + 2,), generator=torch.Generator().manual_seed(5)).tolist()
    cold, cached = generate(stack, 0, ids)
    assert cached == 0
    deadline = time.monotonic() + 30
    while rds.dbsize() < 11:  # the write-back of p0's pages
        assert time.monotonic() < deadline
        time.sleep(0.02)
    want, requests = 11 * PAGE, 1
    for prefill in (1, 2):  # neither holds the pages; p2 reads Redis in its helper process, p1 on its own threads
        hits = [generate(stack, prefill, ids) for _ in range(4)]
        while max(n for _, n in hits) == 0 and len(hits) < 12:  # a loaded host may compute the first ones whole
            hits.append(generate(stack, prefill, ids))
        requests += len(hits)
        for tokens, n in hits:
            assert tokens == cold
            assert n % PAGE == 0 and 0 <= n <= want  # loaded pages, whichever landed before the compute
        assert max(n for _, n in hits) > 0  # loaded, from where the fetch starts (PrefixFetch.split_page)
    time.sleep(1.0)
    assert rds.dbsize() == 11  # nothing the store had was written again under another name
    # each request's prefill span tells the fetch's story: every cached token was a page it loaded
    hit_spans = stack[5].wait_for(lambda spans: len(fetch_spans(spans)) >= requests, timeout=30)
    for span in fetch_spans(hit_spans):
        a = span.attributes
        assert a["pdserve.cached_tokens"] == a["pdserve.cache.fetch_pages_loaded"] * PAGE
        assert a["pdserve.cache.fetch_pages_loaded"] <= a["pdserve.cache.fetch_pages_fetched"]
        assert 0 <= a["pdserve.cache.fetch_start_page"] <= 11 and a["pdserve.cache.fetch_wait_ms"] >= 0
    assert max(s.attributes["pdserve.cache.fetch_pages_loaded"] for s in fetch_spans(hit_spans)) > 0


def fetch_spans(spans) -> list:
    """Prefill request spans that carry a racing fetch's attributes."""
    return [s for s in spans if s.name == "prefill.request" and "pdserve.cache.fetch_pages_loaded" in s.attributes]


def test_the_helper_process_runs_beside_the_third_prefill_only(stack):
    *plain, helped = stack[4]
    assert not any("pdserve.cache.fetch_worker" in c for p in plain for c in children(p))
    assert sum("pdserve.cache.fetch_worker" in c for c in children(helped)) == 1
