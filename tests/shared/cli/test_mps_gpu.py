"""The stack's MPS daemon with the real `nvidia-cuda-mps-control` on a GPU host (skipped elsewhere): it starts under
its guard, a CUDA client runs under it (`MpsDaemon.probe`, which `pdserve up --mps auto` runs before the services),
`Stack.stop`'s cleanup quits it, and a launcher killed outright leaves no daemon behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli.launch import Stack
from pdserve.cli.mps import CONTROL, PIPE_ENV, MpsDaemon
from pdserve.testing.wait import wait_until

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or shutil.which(CONTROL) is None or bool(os.environ.get(PIPE_ENV)),
    reason=f"needs a CUDA GPU and {CONTROL}, and no MPS server of the environment's own",
)


def daemon_pids() -> set[int]:
    """Pids of running (not zombie) `nvidia-cuda-mps-control -f` processes, from /proc."""
    pids = set()
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if argv and argv[0].endswith(CONTROL.encode()) and b"-f" in argv and state != "Z":
            pids.add(int(d.name))
    return pids


def test_real_daemon_runs_a_client_and_quits_with_the_stack(tmp_path):
    daemon = MpsDaemon.start(tmp_path / "mps", os.environ)
    try:
        assert daemon.proc.poll() is None
        assert daemon.probe([0], os.environ) == "", daemon.log_tail()
        servers = daemon.command("get_server_list")
        assert servers is not None and servers.strip(), "the probe's client started no MPS server"
    finally:
        Stack("", [], [], cleanup=[daemon.stop]).stop()
    assert daemon.proc.returncode == 0, daemon.log_tail()


LAUNCHER = """
import os, sys
from pathlib import Path
from pdserve.cli.mps import MpsDaemon
daemon = MpsDaemon.start(Path(sys.argv[1]), os.environ)
print(daemon.proc.pid, flush=True)
sys.stdin.read()
"""


def test_real_daemon_quits_when_its_launcher_is_killed(tmp_path):
    before = daemon_pids()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "mps")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        int(launcher.stdout.readline())  # type: ignore[union-attr]
        ours = daemon_pids() - before
        assert ours, "no control daemon started"
        launcher.kill()
        launcher.wait(10)
        wait_until(lambda: not (daemon_pids() & ours), timeout=60, what="the control daemon to quit")
        assert "is gone: quitting the MPS daemon" in Path(tmp_path / "mps" / "control.out").read_text()
    finally:
        launcher.kill()
