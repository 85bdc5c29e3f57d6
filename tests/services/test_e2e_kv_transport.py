"""Each KV transport forced end to end through real processes (grpc-shm: with both ends' shipper processes):
outputs token-identical to HF (unquantized KV), the forced transport really carried the bytes (Stats counters of
both ends), pools empty afterwards."""

from __future__ import annotations

import pytest
import torch
from services_testutil import pool_empty, tiny_stack

import pdserve
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.wait import wait_until
from pdserve.v1 import internal_pb2, internal_pb2_grpc

PAGE, CHUNK = 4, 8
LENGTHS = [1, PAGE + 1, 3 * CHUNK + 5, 61]


def transports(addr: str, stub_cls) -> tuple[dict, tuple[int, int]]:
    with channel(addr) as ch:
        s = stub_cls(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
    return {t.transport: t for t in s.kv_transports}, (s.kv_pages_free, s.kv_pages_total)


def prefill_sent(addr: str, requests: int) -> dict:
    """Prefill's per-transport counters once it has booked `requests` transfers. It books one when the Prefill RPC
    ends (after decode's last acks and the prompt-cache write-back), which may be just after the client has its
    answer."""

    def booked() -> dict | None:
        sent, _ = transports(addr, internal_pb2_grpc.PrefillStub)
        return sent if sum(t.requests for t in sent.values()) >= requests else None

    return wait_until(booked, what=f"prefill booked {requests} KV transfers")


def prefill_pool_empties(addr: str) -> None:
    """Prefill lets a request's pages go once decode acked them and its RPC ended, which may be just after the
    client has its answer: wait for its pool to be empty (no page leaked)."""
    with channel(addr) as ch:
        wait_until(lambda: pool_empty(internal_pb2_grpc.PrefillStub(ch)), what="prefill's pool empty")


@pytest.mark.parametrize(
    "transport, shippers",
    [("grpc", None), ("cuda-ipc", None), ("grpc-shm", None), ("grpc-shm", (3, 2))],
    ids=["grpc", "cuda-ipc", "grpc-shm", "grpc-shm-3x2"],
)
def test_forced_transport_token_identical_and_taken(transport, shippers, model_dir, hf_model, tmp_path, monkeypatch):
    """grpc-shm with the default --kv-shippers (2 on each end), and with 3 prefill shippers pushing to 2 decode
    shippers."""
    monkeypatch.setenv("PDSERVE_PREFILL_KV_BATCH_MB", "0.001")  # grpc: one page per message (grpc-shm: a batch)
    if shippers is not None:
        monkeypatch.setenv("PDSERVE_PREFILL_KV_SHIPPERS", str(shippers[0]))
        monkeypatch.setenv("PDSERVE_DECODE_KV_SHIPPERS", str(shippers[1]))
    extra = ["--kv-transport", transport]
    with tiny_stack(
        model_dir, tmp_path / "stack", kv_dtype="auto", page_size=PAGE, chunk_size=CHUNK, extra=extra
    ) as stack:
        with pdserve.Client(stack.router, timeout=120) as c:
            for n in LENGTHS:
                ids = torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                out = c.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
                assert out.token_ids == hf_greedy(hf_model, ids, 8), f"{transport}, prompt length {n}"
        sent = prefill_sent(stack.prefill[0], len(LENGTHS))
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
        if transport == "grpc-shm":
            procs = dict(zip(stack.roles, stack.procs))
            want = shippers or (2, 2)
            assert (len(_shippers(procs["prefill"])), len(_shippers(procs["decode"]))) == want
        prefill_pool_empties(stack.prefill[0])


def _shippers(proc) -> list[int]:
    """The pids of a service process's live shipper children (`python -m pdserve.kv.shipper`), whichever of its
    threads started them."""
    from pathlib import Path

    def read(path: str) -> bytes:  # a thread or child may exit between listing and reading: it counts as gone
        try:
            return Path(path).read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return b""

    kids = [k for t in Path(f"/proc/{proc.pid}/task").iterdir() for k in read(f"{t}/children").decode().split()]
    alive = [k for k in kids if (stat := read(f"/proc/{k}/stat")) and stat.rsplit(b")", 1)[1].split()[0] != b"Z"]
    return [int(k) for k in alive if b"pdserve.kv.shipper" in read(f"/proc/{k}/cmdline")]


def test_killed_shippers_start_again_and_requests_go_on(model_dir, hf_model, tmp_path):
    """`--kv-shipper on` on both ends (auto transport: grpc-shm on this CPU host), 2 shippers each (the default).
    One of each service's shippers killed in turn between requests: the next request starts it again (same Push port
    at decode), goes over grpc-shm, and is token-identical; the other shipper runs on; both ends count the restart
    and grpc-shm carried every request."""
    import os
    import signal
    import time

    from pdserve.kv.shipper.link import RESTART_AFTER_S

    with tiny_stack(
        model_dir, tmp_path / "stack", kv_dtype="auto", page_size=PAGE, chunk_size=CHUNK, extra=["--kv-shipper", "on"]
    ) as stack:
        procs = {role: p for role, p in zip(stack.roles, stack.procs) if role in ("prefill", "decode")}
        ids = list(range(5, 5 + 3 * CHUNK + 5))
        want = hf_greedy(hf_model, ids, 6)
        with pdserve.Client(stack.router, timeout=120) as c:
            assert c.generate(token_ids=ids, max_tokens=6, temperature=0, ignore_eos=True).token_ids == want
            for role in ("decode", "prefill"):
                survivor, old = _shippers(procs[role])
                os.kill(old, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while old in _shippers(procs[role]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(RESTART_AFTER_S)  # a shipper is started again at most this often (then on the next request)
                assert c.generate(token_ids=ids, max_tokens=6, temperature=0, ignore_eos=True).token_ids == want
                news = _shippers(procs[role])
                assert len(news) == 2, [ln for ln in stack.log_text().splitlines() if "shipper" in ln]
                assert survivor in news and old not in news
        sent = prefill_sent(stack.prefill[0], 3)
        got, _ = transports(stack.decode[0], internal_pb2_grpc.DecodeStub)
        assert sent["grpc-shm"].requests == got["grpc-shm"].requests == 3, (sent, got)
        prefill_pool_empties(stack.prefill[0])
        logged = stack.log_text()
        assert "kv shipper (decode) exited" in logged and "kv shipper (prefill) exited" in logged, logged[-3000:]
        for address in (stack.prefill[0], stack.decode[0]):
            assert _metric(address.metrics, "pdserve_kv_shipper_total", event="restarts") == 1  # type: ignore[attr-defined]
            assert _metric(address.metrics, "pdserve_kv_shipper_up") == 1  # type: ignore[attr-defined]


def _metric(metrics_address: str, name: str, **labels: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name}{labels} not in {metrics_address}/metrics")
