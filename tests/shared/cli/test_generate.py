"""`pdserve generate` against a scripted router: the prompt goes as one user turn (chat template) by default, as a
prompt with --raw, and falls back to a plain completion, with a note, when the model has no chat template."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.testing.generation_server import generation_server
from pdserve.v1 import generate_pb2, generate_pb2_grpc

NO_TEMPLATE = "this model has no chat template; send prompt or token_ids instead of messages"  # router/chat.py


class Router(generate_pb2_grpc.GenerationServicer):
    """Answers messages with "chat:<content>" (or INVALID_ARGUMENT when `has_template` is off), a prompt with
    "raw:<prompt>"; records each request's max_tokens (None when unset)."""

    def __init__(self, has_template: bool):
        self.has_template = has_template
        self.max_tokens: list[int | None] = []

    def GenerateStream(self, request, context):
        s = request.sampling
        self.max_tokens.append(s.max_tokens if s.HasField("max_tokens") else None)
        if request.messages and not self.has_template:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, NO_TEMPLATE)
        text = f"chat:{request.messages[-1].content}" if request.messages else f"raw:{request.prompt}"
        yield generate_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[5], text=text)


@contextmanager
def router(has_template: bool) -> Iterator[tuple[Router, str]]:
    servicer = Router(has_template)
    with generation_server(servicer, threads=4) as target:
        yield servicer, target


def generate(target: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--target", target, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_chat_template_by_default_and_raw_on_request():
    with router(has_template=True) as (r, target):
        default = generate(target, "hello")
        raw = generate(target, "--raw", "hello")
        capped = generate(target, "--max-tokens", "7", "hello")
    assert default.returncode == raw.returncode == capped.returncode == 0, default.stderr + raw.stderr
    assert (default.stdout, raw.stdout) == ("chat:hello", "raw:hello")
    assert r.max_tokens == [512, None, 7]  # a chat reply's default cap; --raw keeps the API's default


def test_no_chat_template_falls_back_to_a_plain_completion():
    with router(has_template=False) as (r, target):
        res = generate(target, "hello")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "raw:hello" and "no chat template" in res.stderr
    assert r.max_tokens == [512, None]


def test_help_documents_the_chat_template_and_raw():
    res = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--help"], capture_output=True, text=True)
    text = " ".join(res.stdout.split())
    assert "chat template" in text and "--raw" in text and "$PDSERVE_TARGET" in text
