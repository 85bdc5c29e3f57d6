"""The stack's MPS control daemon runs under this guard: it quits the daemon when the launcher is gone.

    python -m pdserve.cli.mps_guard LAUNCHER_PID -- nvidia-cuda-mps-control -f

`MpsDaemon.start` runs the daemon through it. The guard starts the command as its child (same environment, output
and exit code) and waits for it; SIGTERM / SIGINT are passed on. Once its parent is no longer LAUNCHER_PID (the
launcher was killed outright, so `Stack.stop` never ran) it sends the daemon `quit` through the control binary, as
`MpsDaemon.stop` would, and kills it 10 s later if it still runs. Should the guard itself be killed, the daemon
gets SIGKILL from the kernel (PR_SET_PDEATHSIG), so no daemon outlives both.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
POLL_S = 1.0
QUIT_WAIT_S = 10.0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the guard dies (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass


def quit_daemon(control: str, child: subprocess.Popen, wait_s: float = QUIT_WAIT_S) -> None:
    """`quit` through the control binary (its environment names the daemon's pipe directory), then SIGKILL."""
    try:
        subprocess.run([control], input="quit\n", text=True, capture_output=True, timeout=wait_s)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m pdserve.cli.mps_guard LAUNCHER_PID -- CONTROL [ARGS...]", file=sys.stderr)
        return 2
    launcher, cmd = int(argv[0]), argv[2:]
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != launcher:
            print(f"mps_guard: the launcher (pid {launcher}) is gone: quitting the MPS daemon", flush=True)
            quit_daemon(cmd[0], child)
            return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
