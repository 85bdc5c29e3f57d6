"""Engine stand-ins whose pace a test controls, for the tests that need streams of a known length behind a real
router process (thread budget, drain): a decode instance that answers `Decode.Generate` with one token every
`interval_s` for `sampling.max_tokens` tokens (or until the call is cancelled), and a prefill instance that only
answers Stats. Both serve grpc.health.v1 and report a KV pool, so the router treats them as healthy instances."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

TOKEN = 100  # any id inside the tiny checkpoints' vocabulary
STATS = internal_pb2.InstanceStats(
    kv_pages_total=100_000, kv_pages_free=100_000, page_size=16, model_fingerprint="fake", prefill_tokens_per_s=1e6
)


class _Decode(internal_pb2_grpc.DecodeServicer):
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.started = threading.Semaphore(0)  # released once per Generate call that began streaming
        self.active = 0
        self._lock = threading.Lock()

    def Generate(self, request, context):
        n = request.sampling.max_tokens
        done = threading.Event()
        context.add_callback(done.set)
        with self._lock:
            self.active += 1
        self.started.release()
        try:
            for i in range(n):
                last = i == n - 1
                msg = internal_pb2.DecodeResponse(token_ids=[TOKEN], text="x")
                if last:
                    msg.finish_reason = generate_pb2.FINISH_REASON_LENGTH
                    msg.usage.prompt_tokens = len(request.prompt_token_ids)
                    msg.usage.completion_tokens = n
                yield msg
                if not last and done.wait(self.interval_s):
                    return
        finally:
            with self._lock:
                self.active -= 1

    def Stats(self, request, context):
        return STATS


class _Prefill(internal_pb2_grpc.PrefillServicer):
    def Stats(self, request, context):
        return STATS


class FakeEngine:
    """One gRPC server on a loopback port serving Decode (paced) or Prefill (Stats only), plus health."""

    def __init__(self, role: str, interval_s: float = 0.1, threads: int = 64):
        self.server = grpc.server(futures.ThreadPoolExecutor(threads))
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self.server)
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        self.decode = _Decode(interval_s)
        if role == "decode":
            internal_pb2_grpc.add_DecodeServicer_to_server(self.decode, self.server)
        else:
            internal_pb2_grpc.add_PrefillServicer_to_server(_Prefill(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0).wait()
