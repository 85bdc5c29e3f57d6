"""One behaviour contract, three SDKs (issue 33): Python (`pdserve.Client`), Go (clients/go) and TypeScript
(clients/ts) against one live CPU stack of the tiny model with bearer tokens. Each language's contract program
(clients/go/cmd/pdserve-contract, clients/ts/src/examples/contract.ts; built by `make sdk`) reads the same JSON
spec and prints what it observed: greedy token ids (unary and streamed) equal to the Python SDK's; a 1 ms deadline
gives DEADLINE_EXCEEDED; RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms` (a proxy rejecting each request twice)
is retried, streams too; no token gives UNAUTHENTICATED and an unknown one PERMISSION_DENIED; chat messages with
logprobs give the Python SDK's tokens and log-probabilities; ListModels returns the served model, a request naming it
runs, and one naming a model the router does not serve gives NOT_FOUND; a stream cancelled after 3 tokens frees its
KV pages (Stats: all pages free, no active request) and decode ended it as an abort well short of its 1000 tokens
(its log)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from pushback_proxy import PushbackProxy

import pdserve
from pdserve.cli.launch import start_stack
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.v1 import internal_pb2, internal_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
GO_CONTRACT = ROOT / "build" / "go-bin" / "pdserve-contract"
TS_CONTRACT = ROOT / "clients" / "ts" / "dist" / "examples" / "contract.js"
TOKEN, BAD_TOKEN = "tok-contract-0123456789abcdef", "tok-unknown-0123456789abcdef0"
SPEC = {
    "token": TOKEN,
    "bad_token": BAD_TOKEN,
    "prompt_ids": [17, 42, 99, 7, 256, 311, 12, 5],
    "max_tokens": 8,
    "long_tokens": 1000,  # the tiny model's context (1024) less the prompt: minutes of decoding, unless cancelled
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
    "top_logprobs": 3,
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "model": "contract-model",  # the stack's served model name (start_stack model_name=)
    "bad_model": "no-such-model",
}
POOL_FREE_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("contract")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=5)
    tokens = work / "tokens"
    tokens.write_text(f"{TOKEN} contract\n")
    s = start_stack(
        model,
        work,
        kv_dtype="auto",
        page_size=4,
        chunk_size=8,
        extra=["--num-pages", "512", "--torch-threads", "1"],
        router_extra=["--auth-tokens-file", str(tokens)],
        model_name=SPEC["model"],
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def proxy(stack):
    with PushbackProxy(stack.router, rejections=2, pushback_ms=100) as p:
        yield p


def _pools_free(stack) -> bool:
    for addr, stub in [(a, internal_pb2_grpc.PrefillStub) for a in stack.prefill] + [
        (a, internal_pb2_grpc.DecodeStub) for a in stack.decode
    ]:
        with channel(addr) as ch:
            s = stub(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
            if s.kv_pages_free != s.kv_pages_total or s.active_requests:
                return False
    return True


def _wait_pools_free(stack, within_s: float) -> float:
    """Seconds until every pool of `stack` is free again; fails past `within_s`."""
    t0 = time.monotonic()
    while not _pools_free(stack):
        assert time.monotonic() - t0 < within_s, "KV pages still held: the cancelled stream kept generating"
        time.sleep(0.05)
    return time.monotonic() - t0


def _decode_summary(stack, label: str, within_s: float = 10.0) -> tuple[int, str]:
    """(completion_tokens, finish) of the request the caller named `label`, from the router's and decode's logs
    (the router logs label -> its rid, decode logs the rid's end); waits up to `within_s` for the lines."""
    t0 = time.monotonic()
    while True:
        text = "\n".join(p.read_text() for p in stack.logs if p.exists())
        rid = re.search(rf"router rid=(\S+) .*label='{label}'", text)
        end = rid and re.search(rf"decode rid={rid.group(1)} .*completion_tokens=(\d+) finish=(\w+)", text)
        if end:
            return int(end.group(1)), end.group(2)
        assert time.monotonic() - t0 < within_s, f"no router + decode log lines for {label}"
        time.sleep(0.1)


def _assert_cancelled_early(stack, label: str) -> float:
    """The stream `label` was cancelled: its pages are free and decode stopped it long before its max_tokens."""
    free_s = _wait_pools_free(stack, POOL_FREE_WITHIN_S)
    tokens, finish = _decode_summary(stack, label)
    assert finish == "abort" and tokens < SPEC["long_tokens"] // 2, (label, tokens, finish)
    return free_s


def _code(err: grpc.RpcError) -> str:
    return err.code().name


@pytest.fixture(scope="module")
def python_run(stack, proxy) -> dict:
    """The contract through the Python SDK: the reference the other languages must match."""
    sp = SPEC
    meta = [("traceparent", sp["traceparent"])]
    greedy = dict(token_ids=sp["prompt_ids"], max_tokens=sp["max_tokens"], temperature=0, ignore_eos=True)
    out: dict = {}
    with pdserve.Client(stack.router, token=TOKEN, timeout=120) as c:
        out["greedy"] = c.generate(**greedy, metadata=meta, request_id="py-greedy", model=sp["model"]).token_ids
        out["models"] = c.list_models(metadata=meta)
        with pytest.raises(grpc.RpcError) as e:
            c.generate(**greedy, request_id="py-bad-model", model=sp["bad_model"])
        out["unknown_model"] = _code(e.value)
        out["stream_greedy"] = [t for ch in c.stream(**greedy, request_id="py-stream") for t in ch.token_ids]
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=sp["prompt_ids"], max_tokens=sp["long_tokens"], ignore_eos=True, timeout=0.001)
        out["deadline"] = _code(e.value)
        chat = c.generate(
            messages=sp["messages"], max_tokens=sp["max_tokens"], temperature=0, ignore_eos=True,
            logprobs=True, top_logprobs=sp["top_logprobs"],
        )  # fmt: skip
        out["chat"] = {
            "token_ids": chat.token_ids,
            "text": chat.text,
            "logprobs": [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top_ids": [t.token_id for t in lp.top]}
                for lp in chat.logprobs or []
            ],
        }
        received = 0
        long = dict(token_ids=sp["prompt_ids"], max_tokens=sp["long_tokens"], ignore_eos=True, request_id="py-cancel")
        for ch in c.stream(**long):
            received += len(ch.token_ids)
            if received >= 3:
                break  # leaving the loop cancels the call
        out["cancel"] = {"received": received, "after_cancel": "CANCELLED"}
    out["pool_free_s"] = _assert_cancelled_early(stack, "py-cancel")
    with pdserve.Client(f"127.0.0.1:{proxy.port}", token=TOKEN) as rc:
        out["retry"] = rc.generate(**greedy, request_id="py-retry").token_ids
        out["retry_stream"] = [t for ch in rc.stream(**greedy, request_id="py-retry-stream") for t in ch.token_ids]
    for key, token in (("unauthenticated", None), ("wrong_token", BAD_TOKEN)):
        with pdserve.Client(stack.router, token=token, retry=False) as bad, pytest.raises(grpc.RpcError) as e:
            bad.generate(**greedy)
        out[key] = _code(e.value)
    return out


def _run(lang: str, cmd: list[str], stack, proxy) -> dict:
    spec = {**SPEC, "target": stack.router, "retry_target": f"127.0.0.1:{proxy.port}"}
    proc = subprocess.run(cmd, input=json.dumps(spec), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout)
    out["pool_free_s"] = _assert_cancelled_early(stack, f"{lang}-cancel")  # the program's last call
    return out


def _program(lang: str) -> list[str]:
    """The contract program of `lang`; fails (never skips) when it is not built: `make sdk` builds both."""
    if lang == "go":
        assert GO_CONTRACT.exists(), f"{GO_CONTRACT} missing: run `make sdk` (Go toolchain from `make sdk-setup`)"
        return [str(GO_CONTRACT)]
    node = shutil.which("node")
    assert node and TS_CONTRACT.exists(), f"{TS_CONTRACT} or node missing: run `make sdk`"
    return [node, str(TS_CONTRACT)]


def test_python_sdk_keeps_the_contract(python_run, proxy):
    assert len(python_run["greedy"]) == SPEC["max_tokens"]
    assert python_run["stream_greedy"] == python_run["greedy"]
    assert python_run["retry"] == python_run["greedy"] == python_run["retry_stream"]
    assert proxy.attempts["py-retry"] == 3 and proxy.attempts["py-retry-stream"] == 3  # rejected twice, then served
    assert python_run["deadline"] == "DEADLINE_EXCEEDED"
    assert python_run["models"] == [SPEC["model"]]
    assert python_run["unknown_model"] == "NOT_FOUND"
    assert python_run["unauthenticated"] == "UNAUTHENTICATED"
    assert python_run["wrong_token"] == "PERMISSION_DENIED"
    assert len(python_run["chat"]["logprobs"]) == SPEC["max_tokens"]
    assert all(len(lp["top_ids"]) == SPEC["top_logprobs"] for lp in python_run["chat"]["logprobs"])


@pytest.mark.parametrize("lang", ["go", "ts"])
def test_sdk_keeps_the_python_sdk_contract(lang, stack, proxy, python_run):
    out = _run(lang, _program(lang), stack, proxy)
    assert out["greedy"] == python_run["greedy"]
    assert out["stream_greedy"] == python_run["greedy"]
    assert out["retry"] == out["retry_stream"] == python_run["greedy"]
    assert proxy.attempts[f"{lang}-retry"] == 3 and proxy.attempts[f"{lang}-retry-stream"] == 3
    assert out["deadline"] == "DEADLINE_EXCEEDED"
    assert out["models"] == [SPEC["model"]]
    assert out["unknown_model"] == "NOT_FOUND"
    assert out["unauthenticated"] == "UNAUTHENTICATED"
    assert out["wrong_token"] == "PERMISSION_DENIED"
    assert out["chat"]["token_ids"] == python_run["chat"]["token_ids"]
    assert out["chat"]["text"] == python_run["chat"]["text"]
    for got, want in zip(out["chat"]["logprobs"], python_run["chat"]["logprobs"], strict=True):
        assert got["token_id"] == want["token_id"] and got["top_ids"] == want["top_ids"]
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-6)  # the same float32 on the wire
    assert out["cancel"]["received"] >= 3
    assert out["cancel"]["after_cancel"] == "CANCELED"  # gRPC-Go's and Connect's spelling of CANCELLED
