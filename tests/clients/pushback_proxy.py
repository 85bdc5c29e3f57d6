"""A Generation proxy in front of a live router that rejects the first `rejections` attempts of each request_id
with RESOURCE_EXHAUSTED and a `grpc-retry-pushback-ms` trailer, then forwards the call (metadata included): what
the SDKs' retry must get through. `attempts` counts the calls per request_id."""

from __future__ import annotations

from collections import Counter
from concurrent import futures
from threading import Lock

import grpc

from pdserve.v1 import generate_pb2_grpc


class PushbackProxy(generate_pb2_grpc.GenerationServicer):
    def __init__(self, router: str, rejections: int = 2, pushback_ms: int = 100):
        self.rejections, self.pushback_ms = rejections, pushback_ms
        self.attempts: Counter[str] = Counter()
        self._lock = Lock()
        self._channel = grpc.insecure_channel(router)
        self._router = generate_pb2_grpc.GenerationStub(self._channel)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generate_pb2_grpc.add_GenerationServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> PushbackProxy:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)
        self._channel.close()

    def _admit(self, request, context) -> list[tuple[str, str]]:
        with self._lock:
            self.attempts[request.request_id] += 1
            n = self.attempts[request.request_id]
        if n <= self.rejections:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(self.pushback_ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "proxy: at capacity, come back later")
        return [(k, v) for k, v in context.invocation_metadata() if k in ("authorization", "traceparent")]

    def Generate(self, request, context):
        return self._router.Generate(request, metadata=self._admit(request, context), timeout=60)

    def GenerateStream(self, request, context):
        yield from self._router.GenerateStream(request, metadata=self._admit(request, context), timeout=60)
