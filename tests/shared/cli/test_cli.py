"""`pdserve up` as a subprocess, talked to through the SDK and through `pdserve generate`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

import pdserve
from pdserve.cli.launch import Address
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.auth import new_token
from pdserve.testing.up_process import read_banner, stop

TOKEN = new_token()  # the stack's internal token: `pdserve up` takes it from the environment


@pytest.fixture(scope="module")
def up_and_gateway(tmp_path_factory):
    model = build_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt", arch="qwen2", seed=2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(model),
            "--port",
            "0",
            "--gateway-port",
            "0",
            "--prefill",
            "2",
            "--decode",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache")), "PDSERVE_INTERNAL_TOKEN": TOKEN},
    )
    banner = read_banner(proc, timeout_s=180)
    assert any("PLAINTEXT" in line for line in banner.lines)  # `pdserve up` says what it does not protect
    yield Address(banner.router, banner.internal), (banner.gateway, banner.model_name)
    stop(proc, timeout_s=30)


@pytest.fixture(scope="module")
def up(up_and_gateway):
    return up_and_gateway[0]


def test_gateway_started_by_up(up_and_gateway):
    import openai

    target, (base_url, model) = up_and_gateway
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [model] == ["ckpt"]
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    with pdserve.Client(target, timeout=60) as c:
        ref = c.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0)
    assert out.choices[0].message.content == ref.text


def test_sdk_against_pdserve_up(up):
    with pdserve.Client(up, timeout=60) as c:
        out = c.generate(prompt="hello", max_tokens=8, temperature=0, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.token_ids) == 8
        assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
        streamed = list(c.stream(prompt="hello", max_tokens=8, temperature=0, ignore_eos=True))
        assert [t for ch in streamed for t in ch.token_ids] == out.token_ids


def test_async_client(up):
    async def run():
        async with pdserve.AsyncClient(up, timeout=60) as c:
            out = await c.generate(prompt="hello", max_tokens=5, temperature=0, ignore_eos=True)
            chunks = [ch async for ch in c.stream(prompt="hello", max_tokens=5, temperature=0, ignore_eos=True)]
            return out, chunks

    out, chunks = asyncio.run(run())
    assert [t for ch in chunks for t in ch.token_ids] == out.token_ids and len(out.token_ids) == 5


def test_up_runs_the_requested_instances(up):
    from pdserve.server.grpc_util import channel
    from pdserve.server.security import ChannelSecurity
    from pdserve.v1 import router_admin_pb2 as pb
    from pdserve.v1 import router_admin_pb2_grpc

    with channel(up.internal, ChannelSecurity(token=TOKEN)) as ch:  # the Registry: internal port, internal token
        r = router_admin_pb2_grpc.RegistryStub(ch).ListInstances(pb.ListInstancesRequest(), timeout=10)
    with channel(up.internal, ChannelSecurity()) as ch, pytest.raises(grpc.RpcError) as e:
        router_admin_pb2_grpc.RegistryStub(ch).ListInstances(pb.ListInstancesRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    roles = sorted(pb.InstanceRole.Name(i.role) for i in r.instances if i.state == "up")
    assert roles == ["INSTANCE_ROLE_DECODE", "INSTANCE_ROLE_PREFILL", "INSTANCE_ROLE_PREFILL"]


def _cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`pdserve ARGS...` in a subprocess, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def test_generate_command(up):
    res = _cli("generate", "--target", up, "--raw", "--max-tokens", "6", "--temperature", "0", "hello")
    assert res.returncode == 0, res.stderr
    assert "finish=" in res.stderr and "completion_tokens=6" in res.stderr
    with pdserve.Client(up, timeout=60) as c:
        assert res.stdout == c.generate(prompt="hello", max_tokens=6, temperature=0).text


def test_generate_applies_the_chat_template_by_default(up):
    res = _cli("generate", "--target", up, "--max-tokens", "6", "--temperature", "0", "hello")
    assert res.returncode == 0, res.stderr
    with pdserve.Client(up, timeout=60) as c:
        reply = c.chat([{"role": "user", "content": "hello"}], max_tokens=6, temperature=0)
        raw = c.generate(prompt="hello", max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens > raw.usage.prompt_tokens  # the template wrapped the prompt
    assert res.stdout == reply.text
    assert f"prompt_tokens={reply.usage.prompt_tokens} " in res.stderr


def test_generate_command_reports_bad_input(up):
    res = _cli("generate", "--target", up, "--max-tokens", "0", "hello")
    assert res.returncode == 1 and "INVALID_ARGUMENT" in res.stderr and "max_tokens" in res.stderr


def _chat(up: str, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return _cli("chat", "--target", up, "--temperature", "0", *flags, stdin=stdin, timeout=120)


def test_chat_command_keeps_history_resets_and_ends_at_eof(up):
    res = _chat(up, "hello\n\nhow are you\n/reset\nhello\n", "--max-tokens", "5", "--system", "Be brief.")
    assert res.returncode == 0, res.stderr
    sys_msg = {"role": "system", "content": "Be brief."}
    with pdserve.Client(up, timeout=60) as c:
        first = c.chat([sys_msg, {"role": "user", "content": "hello"}], temperature=0, max_tokens=5).text
        history = [sys_msg, {"role": "user", "content": "hello"}, {"role": "assistant", "content": first}]
        second = c.chat([*history, {"role": "user", "content": "how are you"}], temperature=0, max_tokens=5).text
    assert res.stdout == f"{first}\n{second}\n{first}\n"  # the empty line is skipped; /reset forgets the turns
    assert "[history cleared]" in res.stderr


def test_chat_command_reports_errors_and_goes_on(up):
    res = _chat(up, "hello\n/exit\nnever sent\n", "--max-tokens", "0")
    assert res.returncode == 0 and "INVALID_ARGUMENT" in res.stderr and "max_tokens" in res.stderr
    assert res.stdout == "\n"


def test_chat_command_caps_replies_by_default(up):
    """No --max-tokens: a reply ends at EOS or after DEFAULT_MAX_TOKENS (not the prompt API's 16, and not at the
    end of the 1024-token context, where a greedy loop would otherwise run)."""
    from pdserve.cli.chat import DEFAULT_MAX_TOKENS

    with pdserve.Client(up, timeout=120) as c:
        ref = c.chat([{"role": "user", "content": "hello"}], temperature=0, max_tokens=DEFAULT_MAX_TOKENS)
    res = _chat(up, "hello\n")
    assert res.returncode == 0 and res.stdout == ref.text + "\n"
    assert ref.usage.completion_tokens == DEFAULT_MAX_TOKENS or ref.finish_reason == "stop"
    assert ref.usage.completion_tokens > 16 or ref.finish_reason == "stop"
