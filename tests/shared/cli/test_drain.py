"""Ctrl-C on `pdserve up`: the terminal signals the launcher's whole process group; the services run in sessions of
their own, so each sees one signal (from the launcher) and drains: a request in flight completes, then every
process exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.auth import new_token
from pdserve.testing.up_process import read_banner

MAX_TOKENS = 600  # long enough to be in flight when the signal comes (the tiny model's context is 1024)


def _start_up(tmp_path, token: str) -> tuple[subprocess.Popen, list[str], str]:
    model = build_checkpoint(tmp_path / "ckpt", arch="llama", seed=3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--port", "0", "--gateway-port", "-1"]
        + ["--torch-threads", "1", "--drain-grace-s", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a process group of its own, as a shell gives a foreground job
        env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PDSERVE_INTERNAL_TOKEN": token},
    )
    banner = read_banner(proc, timeout_s=240, gateway=False)
    return proc, banner.lines, banner.router


@pytest.mark.timeout(420)
def test_ctrl_c_drains_the_request_in_flight_then_everything_exits(tmp_path):
    proc, lines, target = _start_up(tmp_path, new_token())
    try:
        services = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
                    .stdout.split()]  # fmt: skip
        assert len(services) == 3, services  # prefill, decode, router
        chunks_after = 0
        last = None
        with pdserve.Client(target, timeout=300) as client:
            stream = client.stream("hello", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            first = next(stream)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
            for chunk in stream:
                chunks_after, last = chunks_after + 1, chunk
        assert last is not None and last.finish_reason == "length", last
        assert last.usage.completion_tokens == MAX_TOKENS and first.text is not None
        assert chunks_after > 0  # the request was still generating when the signal came
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert "draining in-flight requests" in out and "pdserve up: stopped" in out, out[-3000:]
    assert "second signal" not in out, out[-3000:]
    for pid in services:  # every service exited (and was reaped by the launcher)
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
