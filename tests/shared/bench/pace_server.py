"""A Generation server with a known pace, to check what `pdserve bench` measures: the first token `ttft_s` after the
request, then one token per chunk every `interval_s`, exactly `max_tokens` of them (it insists on ignore_eos and
token ids, as the bench sends). Prompts of `reject_len` tokens get INVALID_ARGUMENT, of `busy_len` tokens
RESOURCE_EXHAUSTED. It keeps every prompt it received and each call's `authorization` metadata; with `tls` (a
TlsConfig) it serves TLS. Runs in a thread of its own (its own event loop).

    python pace_server.py PORT_FILE [TTFT_S INTERVAL_S [PORT]]   # standalone, for client-capacity measurements
    (several on one PORT share it: gRPC servers bind with SO_REUSEPORT, the kernel spreads the connections)
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import grpc

from pdserve.server.tls import TlsConfig
from pdserve.v1 import generate_pb2, generate_pb2_grpc


class PacedGeneration(generate_pb2_grpc.GenerationServicer):
    def __init__(self, ttft_s: float, interval_s: float, reject_len: int = -1, busy_len: int = -1):
        self.ttft_s, self.interval_s = ttft_s, interval_s
        self.reject_len, self.busy_len = reject_len, busy_len
        self.prompts: list[list[int]] = []
        self.authorization: list[str | None] = []

    async def GenerateStream(self, request, context):
        ids = list(request.token_ids.ids)
        self.prompts.append(ids)
        self.authorization.append(dict(context.invocation_metadata()).get("authorization"))
        if request.WhichOneof("input") != "token_ids" or not request.sampling.ignore_eos:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the bench sends token ids with ignore_eos")
        if len(ids) == self.reject_len:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rejected length")
        if len(ids) == self.busy_len:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        n = request.sampling.max_tokens
        loop = asyncio.get_running_loop()
        start = loop.time()
        for k in range(n):  # token k is due at ttft + k * interval after receipt, whatever the sleeps overshoot
            await asyncio.sleep(max(0.0, start + self.ttft_s + k * self.interval_s - loop.time()))
            last = k == n - 1
            yield generate_pb2.GenerateStreamResponse(
                request_id=request.request_id,
                token_ids=[7],
                text="x",
                finish_reason=generate_pb2.FINISH_REASON_LENGTH if last else generate_pb2.FINISH_REASON_UNSPECIFIED,
                usage=generate_pb2.Usage(prompt_tokens=len(ids), completion_tokens=n) if last else None,
            )


class PaceServer:
    """`with PaceServer(ttft_s, interval_s) as s:` serves on 127.0.0.1:s.port in a background thread."""

    def __init__(
        self, ttft_s: float = 0.05, interval_s: float = 0.01, tls: TlsConfig | None = None, port: int = 0, **kw
    ):
        self.servicer = PacedGeneration(ttft_s, interval_s, **kw)
        self.tls = tls
        self.port = port
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        if self.tls is None:
            self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        else:
            creds = self.tls.server_credentials(require_client_auth=False)
            self.port = server.add_secure_port(f"127.0.0.1:{self.port}", creds)
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> PaceServer:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("pace server did not start")
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


if __name__ == "__main__":
    pace = [float(x) for x in sys.argv[2:4]] or [0.05, 0.01]
    with PaceServer(*pace, port=int(sys.argv[4]) if len(sys.argv) > 4 else 0) as s:
        Path(sys.argv[1]).write_text(s.target)
        threading.Event().wait()
