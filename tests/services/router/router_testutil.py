"""Helpers of the router tests: the router's instance listing, waiting for instance states, a stream across the
kill of the engine that serves it."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Collection

import pdserve
from pdserve.server.grpc_util import channel
from pdserve.v1 import router_admin_pb2 as pb
from pdserve.v1 import router_admin_pb2_grpc

# engine flags of the failover tests' small instances: one thread, a small fp32 pool, unquantized KV
ENGINE_FLAGS = [
    "--torch-threads",
    "1",
    "--page-size",
    "16",
    "--max-num-seqs",
    "8",
    "--num-pages",
    "512",
    "--kv-dtype",
    "auto",
]


def listing(router: str) -> pb.ListInstancesResponse:
    """The Registry's listing, from the router's internal port (`launch.Address.internal`; a plain address: as is)."""
    with channel(getattr(router, "internal", router)) as ch:
        return router_admin_pb2_grpc.RegistryStub(ch).ListInstances(pb.ListInstancesRequest(), timeout=10)


def instances(router: str) -> dict[str, pb.InstanceInfo]:
    return {i.address: i for i in listing(router).instances}


def wait_states(router: str, want: dict[str, str | None], timeout: float = 60.0) -> None:
    """Wait until each address has the given state (None: absent from the router's table)."""
    deadline = time.monotonic() + timeout
    while True:
        have = instances(router)
        got = {a: (have[a].state if a in have else None) for a in want}
        if got == want:
            return
        assert time.monotonic() < deadline, f"router {router}: {got}, wanted {want}"
        time.sleep(0.1)


def collect(chunks) -> dict:
    """A stream's tokens, text, finish reason and usage."""
    out: dict = {"tokens": [], "text": "", "finish": None, "usage": None}
    for c in chunks:
        out["tokens"] += c.token_ids
        out["text"] += c.text
        if c.finish_reason:
            out["finish"], out["usage"] = c.finish_reason, c.usage
    return out


def kill_mid_stream_is_invisible(
    router: str, kw: dict, engines: Collection[str], procs: dict[str, subprocess.Popen], after_tokens: int = 10
) -> tuple[str, list[float]]:
    """Stream `kw` (Client.stream's arguments, with token_ids, max_tokens and ignore_eos) through `router` once
    uninterrupted, then again, SIGKILLing the one engine of `engines` serving it (its process in `procs`) after
    `after_tokens` tokens; checks that the caller's stream is the same (tokens, text, finish reason, usage), that
    the router retried once and marked the engine down. Returns the killed address and the seconds between chunk
    arrivals from the kill on."""
    with pdserve.Client(router, timeout=120) as c:
        ref = collect(c.stream(**kw))
        assert len(ref["tokens"]) == kw["max_tokens"]
        retries = listing(router).retries
        stream = c.stream(**kw)
        head = []
        for chunk in stream:  # a few tokens, then kill the instance serving this request
            head.append(chunk)
            if sum(len(x.token_ids) for x in head) >= after_tokens:
                break
        serving = [a for a, i in instances(router).items() if a in engines and i.in_flight]
        assert len(serving) == 1, instances(router)
        proc = procs[serving[0]]
        proc.send_signal(signal.SIGKILL)
        killed_at = time.perf_counter()
        proc.wait(timeout=10)
        rest, arrivals = [], [killed_at]
        for chunk in stream:
            rest.append(chunk)
            arrivals.append(time.perf_counter())
    got = collect(head + rest)
    assert sum(len(x.token_ids) for x in head) < kw["max_tokens"]  # the kill happened mid-stream
    assert got["tokens"] == ref["tokens"], len(got["tokens"])
    assert got["text"] == ref["text"]
    assert got["finish"] == ref["finish"] == "length"
    assert (got["usage"].prompt_tokens, got["usage"].completion_tokens) == (len(kw["token_ids"]), kw["max_tokens"])
    assert listing(router).retries == retries + 1
    assert instances(router)[serving[0]].state == "down"
    return serving[0], [b - a for a, b in zip(arrivals, arrivals[1:])]
