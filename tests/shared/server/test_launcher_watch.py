"""A service started by a launcher ends when the launcher is killed outright (SIGKILL: no `Stack.stop`): the watch
sends the service SIGTERM once it is reparented, and the service drains and exits like at `Stack.stop`. Services
started without a launcher pid (by hand, Compose, Kubernetes) are not watched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve.server.launcher_watch import LAUNCHER_PID_ENV, launcher_pid, watch_launcher
from pdserve.testing.wait import wait_until


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_launcher_pid_from_the_environment():
    assert launcher_pid({}) is None and launcher_pid({LAUNCHER_PID_ENV: " "}) is None
    assert launcher_pid({LAUNCHER_PID_ENV: "1234"}) == 1234
    assert launcher_pid({LAUNCHER_PID_ENV: "1"}) is None  # init: nothing to outlive
    with pytest.raises(SystemExit, match="must be a process id"):
        launcher_pid({LAUNCHER_PID_ENV: "abc"})


def test_the_watch_fires_only_once_the_parent_is_not_the_launcher():
    assert watch_launcher({}) is None
    fired, stop = threading.Event(), threading.Event()
    thread = watch_launcher({LAUNCHER_PID_ENV: str(os.getppid())}, fired.set, poll_s=0.01, stop=stop)
    assert thread is not None
    time.sleep(0.2)
    assert not fired.is_set()  # our parent is that launcher
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and not fired.is_set()
    other = watch_launcher({LAUNCHER_PID_ENV: str(os.getppid() + 100_000)}, fired.set, poll_s=0.01)
    assert other is not None and fired.wait(5)  # started by someone else: that launcher is gone


LAUNCHER = """
import sys
from pathlib import Path
from pdserve.cli.launch import start_service, wait_ready
work, model = Path(sys.argv[1]), sys.argv[2]
args = ["--model", model, "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9", "--estimator-store", "memory",
        "--insecure"]
proc, ready, log = start_service("router", args, work)
wait_ready(proc, ready, log)
print(proc.pid, flush=True)
sys.stdin.read()  # until the test kills this launcher
"""


def test_a_service_ends_when_its_launcher_is_killed(tmp_path):
    from pdserve.models.checkpoints import build_checkpoint

    model = build_checkpoint(tmp_path / "ckpt", arch="llama", seed=1)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(model)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = launcher.stdout.readline()  # type: ignore[union-attr]
        assert line.strip(), "the launcher did not start its router"
        service = int(line)
        assert alive(service)
        ready = json.loads((tmp_path / "router0.json").read_text())
        assert ready["address"]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        wait_until(lambda: not alive(service), timeout=30, what="the router to exit after its launcher died")
        log = (tmp_path / "router0.log").read_text()
        assert "the launcher" in log and "is gone: shutting down" in log
    finally:
        if launcher.poll() is None:
            launcher.kill()
        try:
            os.kill(service, signal.SIGKILL)
        except (ProcessLookupError, NameError, UnboundLocalError):
            pass
