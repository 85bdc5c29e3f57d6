"""What the gateway tests share: a scripted gRPC router (each prompt names the status it answers with), a gateway
process in front of a router address, and raw HTTP/1.1 exchanges (bytes the `openai` client would never send)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from pdserve.cli.launch import start_service, wait_ready
from pdserve.testing.generation_server import generation_server
from pdserve.v1 import generate_pb2, generate_pb2_grpc

INVALID_PREFIX = "invalid:"  # a prompt "invalid:REASON" is answered INVALID_ARGUMENT with REASON


class ScriptedRouter(generate_pb2_grpc.GenerationServicer):
    """Reads its script from `prompt` (or a chat's last message): a status code name is answered with that status
    (RESOURCE_EXHAUSTED with a retry-after-ms trailer), "invalid:REASON" with INVALID_ARGUMENT and REASON,
    anything else with a two-chunk completion; records the metadata of every call."""

    def __init__(self):
        self.metadata: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def GenerateStream(self, request, context):
        with self.lock:
            self.metadata.append(dict(context.invocation_metadata()))
        script = request.messages[-1].content if request.messages else request.prompt
        if script.startswith(INVALID_PREFIX):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, script.removeprefix(INVALID_PREFIX))
        if script in grpc.StatusCode.__members__:
            if script == "RESOURCE_EXHAUSTED":
                context.set_trailing_metadata((("retry-after-ms", "2500"),))
            context.abort(grpc.StatusCode[script], f"scripted {script}")
        yield generate_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[5], text="he")
        yield generate_pb2.GenerateStreamResponse(
            request_id=request.request_id,
            token_ids=[6],
            text="llo",
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=1, completion_tokens=2),
        )

    def Generate(self, request, context):
        chunks = list(self.GenerateStream(request, context))
        return generate_pb2.GenerateResponse(
            request_id=request.request_id,
            token_ids=[5, 6],
            text="hello",
            finish_reason=chunks[-1].finish_reason,
            usage=chunks[-1].usage,
        )


@contextmanager
def scripted_router() -> Iterator[tuple[ScriptedRouter, str]]:
    """A ScriptedRouter on a free loopback port: (servicer, host:port)."""
    servicer = ScriptedRouter()
    with generation_server(servicer) as target:
        yield servicer, target


@contextmanager
def running_gateway(router: str, work: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """`pdserve serve gateway --router ROUTER --model-name m FLAGS` until the block ends: (host, port)."""
    proc, ready, log = start_service("gateway", ["--router", router, "--model-name", "m", *flags], work)
    try:
        host, port = wait_ready(proc, ready, log, timeout=60).rsplit(":", 1)
        yield host, int(port)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def exchange(
    gateway: tuple[str, int], path: str, body: bytes, headers: dict[str, str | bytes] | None = None
) -> tuple[int, bytes]:
    """POST raw `body` with raw header values (str ones go out as latin-1); (status, the answer's bytes)."""
    conn = http.client.HTTPConnection(*gateway, timeout=120)
    try:
        conn.putrequest("POST", path)
        for k, v in {"content-type": "application/json", "content-length": str(len(body)), **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post(
    gateway: tuple[str, int], path: str, body: bytes, headers: dict[str, str | bytes] | None = None
) -> tuple[int, dict]:
    """`exchange`, for a JSON answer: (status, the answer)."""
    status, answer = exchange(gateway, path, body, headers)
    return status, json.loads(answer)


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length from a raw socket: (status, headers lowercased, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body
