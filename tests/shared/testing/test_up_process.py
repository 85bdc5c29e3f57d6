"""`read_banner` / `stop` against a small child that prints what `pdserve up` prints (the real one runs in
tests/shared/cli/test_cli.py and test_drain.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.testing.up_process import read_banner, stop
from pdserve.testing.wait import wait_until

BANNER = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print("starting", flush=True)
if sys.argv[1] == "die":
    sys.exit(3)
print("pdserve is up: router at 127.0.0.1:5001  (internal 127.0.0.1:5002; 1 prefill, 1 decode, kv int8)", flush=True)
print("OpenAI-compatible gateway at http://127.0.0.1:5003/v1  (model 'tiny')", flush=True)
print("later log line", flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def child(mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BANNER, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_banner_addresses_then_the_pipe_stays_drained():
    proc = child("run")
    banner = read_banner(proc, timeout_s=30)
    assert (banner.router, banner.internal) == ("127.0.0.1:5001", "127.0.0.1:5002")
    assert (banner.gateway, banner.model_name) == ("http://127.0.0.1:5003/v1", "tiny")
    assert banner.lines[0] == "starting\n"
    wait_until(lambda: "later log line\n" in banner.lines, timeout=30, what="the reader thread's line")
    stop(proc, timeout_s=30)
    assert proc.returncode == 0
    wait_until(lambda: "stopped\n" in banner.lines, timeout=30, what="the line printed on SIGINT")


def test_router_only_stops_at_the_router_line():
    proc = child("run")
    banner = read_banner(proc, timeout_s=30, gateway=False)
    assert banner.router == "127.0.0.1:5001" and banner.gateway is None and banner.model_name is None
    stop(proc, timeout_s=30)


def test_an_exit_before_the_banner_reports_the_output():
    proc = child("die")
    with pytest.raises(RuntimeError, match=r"exited \(3\) before it was ready:\nstarting"):
        read_banner(proc, timeout_s=30)


def test_a_stack_that_ignores_ctrl_c_is_killed_and_fails():
    proc = child("ignore")
    read_banner(proc, timeout_s=30)
    with pytest.raises(subprocess.TimeoutExpired):
        stop(proc, timeout_s=0.5)
    assert proc.wait(timeout=30) < 0  # killed by a signal
