"""Thread budgets and the router's shutdown over real processes (issue 13, parts 3 and 7).

- 2x the stream budget of long streams: the extra ones fail RESOURCE_EXHAUSTED at once (with a retry-after) and
  health checks, Stats and the Registry still answer within their deadlines (a real router in front of paced
  engine stand-ins, and a real prefill instance holding idle KV streams).
- SIGTERM: in-flight streams finish within --drain-grace-s, those still running then end with UNAVAILABLE
  "router shutting down", new calls are refused, the process exits; a second SIGTERM ends it at once; a SIGTERM
  during startup ends it before it serves.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from fake_engines import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services_testutil import running_service

from pdserve.cli.launch import start_service, wait_ready
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, generate_pb2_grpc, internal_pb2, internal_pb2_grpc, router_admin_pb2_grpc
from pdserve.v1 import router_admin_pb2 as admin_pb2

BUDGET = 4
HEALTH_DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("limits") / "ckpt", arch="llama", seed=5)


@pytest.fixture
def fakes():
    pre, dec = FakeEngine("prefill"), FakeEngine("decode", interval_s=0.1)
    yield pre, dec
    pre.stop()
    dec.stop()


def start_router(model: Path, work: Path, fakes, *flags: str):
    pre, dec = fakes
    args = ["--model", str(model), "--prefill", pre.address, "--decode", dec.address, "--estimator-store", "memory"]
    proc, ready, log = start_service("router", [*args, "--health-interval-s", "0.2", *flags], work)
    return proc, ready, log


class Stream:
    """One GenerateStream read on its own thread: chunks as they come, then the final status."""

    def __init__(self, stub, max_tokens: int):
        req = generate_pb2.GenerateRequest(prompt="hello", sampling=generate_pb2.SamplingParams(max_tokens=max_tokens))
        self.call = stub.GenerateStream(req, timeout=120)
        self.chunks: list[generate_pb2.GenerateStreamResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for c in self.call:
                self.chunks.append(c)
        except grpc.RpcError as e:
            self.error = e
        self.ended_at = time.monotonic()
        self.done.set()

    @property
    def code(self):
        return self.error.code() if self.error is not None else grpc.StatusCode.OK


def health_ok(ch: grpc.Channel, service: str = "") -> float:
    """Seconds one health check took (it must answer SERVING within HEALTH_DEADLINE_S)."""
    t0 = time.monotonic()
    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_DEADLINE_S)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - t0


def test_router_refuses_streams_beyond_its_budget_and_stays_healthy(model, tmp_path, fakes):
    proc, ready, log = start_router(model, tmp_path, fakes, "--max-streams", str(BUDGET), "--control-threads", "4")
    try:
        addr = wait_ready(proc, ready, log, timeout=120)
        with grpc.insecure_channel(addr) as ch, channel(addr.internal) as ich:
            stub = generate_pb2_grpc.GenerationStub(ch)
            held = [Stream(stub, 900) for _ in range(BUDGET)]
            for _ in range(BUDGET):  # every held stream reached the decode stand-in
                assert fakes[1].decode.started.acquire(timeout=30)
            t0 = time.monotonic()
            extra = [Stream(stub, 900) for _ in range(BUDGET)]
            for s in extra:
                assert s.done.wait(5), "a stream beyond the budget was not refused at once"
                assert s.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (s.code, s.error)
                assert "--max-streams" in s.error.details()
                assert dict(s.error.trailing_metadata())["retry-after-ms"]
            assert max(s.ended_at for s in extra) - t0 < 5.0
            # control RPCs find a thread while the budget is taken: public and internal health, the Registry
            for _ in range(10):
                assert health_ok(ch) < HEALTH_DEADLINE_S
                assert health_ok(ich) < HEALTH_DEADLINE_S
            listing = router_admin_pb2_grpc.RegistryStub(ich).ListInstances(
                admin_pb2.ListInstancesRequest(), timeout=HEALTH_DEADLINE_S
            )
            assert {i.state for i in listing.instances} == {"up"}
            assert not any(s.done.is_set() for s in held)  # the held ones still stream
            for s in held:
                s.call.cancel()
            wait_until(lambda: fakes[1].decode.active == 0, timeout=10, what="decode streams cancelled")
            # slots come back: a new stream is served again
            again = Stream(stub, 3)
            assert again.done.wait(30) and again.code == grpc.StatusCode.OK and len(again.chunks) == 3
    finally:
        proc.terminate()
        proc.wait(30)


def _idle_prefill_stream(stub, release: threading.Event):
    def nothing():
        release.wait()
        return
        yield  # a request iterator that sends nothing until released

    return stub.Prefill(nothing(), timeout=60)


def test_prefill_refuses_kv_streams_beyond_its_budget(model, tmp_path):
    args = ["--model", str(model), "--torch-threads", "1", "--max-streams", "2", "--control-threads", "2"]
    release = threading.Event()
    with running_service("prefill", args, tmp_path) as addr, channel(addr) as ch:
        stub = internal_pb2_grpc.PrefillStub(ch)
        outcomes: list[grpc.StatusCode] = []

        def read(call):
            try:
                for _ in call:
                    pass
                outcomes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                outcomes.append(e.code())

        calls = [_idle_prefill_stream(stub, release) for _ in range(4)]
        for c in calls:
            threading.Thread(target=read, args=(c,), daemon=True).start()
        wait_until(lambda: len(outcomes) >= 2, timeout=5, what="two streams refused")
        assert outcomes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
        for _ in range(10):
            assert health_ok(ch) < HEALTH_DEADLINE_S
            internal_pb2_grpc.PrefillStub(ch).Stats(internal_pb2.StatsRequest(), timeout=HEALTH_DEADLINE_S)
        assert len(outcomes) == 2  # the two admitted streams are still open
        release.set()
        for c in calls:
            c.cancel()


def test_router_sigterm_finishes_short_streams_and_ends_long_ones(model, tmp_path, fakes):
    grace = 3.0
    proc, ready, log = start_router(model, tmp_path, fakes, "--drain-grace-s", str(grace))
    addr = wait_ready(proc, ready, log, timeout=120)
    try:
        with grpc.insecure_channel(addr) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            short, long_ = Stream(stub, 15), Stream(stub, 900)  # 1.5 s and 90 s of tokens
            wait_until(lambda: short.chunks and long_.chunks, timeout=30, what="both streams started")
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert short.done.wait(grace + 5)
            assert short.code == grpc.StatusCode.OK, short.error
            assert short.chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert sum(len(c.token_ids) for c in short.chunks) == 15
            with pytest.raises(grpc.RpcError) as refused:  # no new work while draining
                stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert long_.done.wait(grace + 10)
            assert long_.code == grpc.StatusCode.UNAVAILABLE and long_.error.details() == "router shutting down"
            assert grace - 0.5 <= long_.ended_at - t_term <= grace + 4.0
            assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_second_sigterm_exits_at_once(model, tmp_path, fakes):
    proc, ready, log = start_router(model, tmp_path, fakes, "--drain-grace-s", "120")
    addr = wait_ready(proc, ready, log, timeout=120)
    try:
        with grpc.insecure_channel(addr) as ch:
            held = Stream(generate_pb2_grpc.GenerationStub(ch), 900)
            wait_until(lambda: held.chunks, timeout=30, what="stream started")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "draining" in log.read_text(), timeout=10, what="drain started")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(5) == 128 + signal.SIGTERM
            assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_during_startup_is_honoured(model, tmp_path, fakes):
    proc, ready, log = start_router(model, tmp_path, fakes)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) != 0
    assert not ready.exists()
