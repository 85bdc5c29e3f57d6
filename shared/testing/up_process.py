"""`pdserve up` as a child process of a test: read its banner (the router's and the gateway's address) from its
output, keep its pipe drained, stop it as Ctrl-C does."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

ROUTER_LINE = re.compile(r"router at (\S+)\s+\(internal ([^;]+);")
GATEWAY_LINE = re.compile(r"gateway at (http://\S+/v1)\s+\(model '([^']+)'\)")


@dataclass
class UpBanner:
    """What `pdserve up` printed once its stack was ready."""

    router: str  # the router's address for the SDK (host:port)
    internal: str  # the router's internal address (what engines and peers dial)
    gateway: str | None = None  # the OpenAI gateway's base URL (http://host:port/v1); None when not waited for
    model_name: str | None = None  # the model's name in the gateway's API
    lines: list[str] = field(default_factory=list)  # every line printed so far; a reader thread keeps adding


def read_banner(proc: subprocess.Popen, timeout_s: float, gateway: bool = True) -> UpBanner:
    """Read `proc`'s text stdout until the router's line (and, with `gateway`, the gateway's, which comes after
    it); then a daemon thread keeps reading into `lines`, since the services log to that pipe and a full pipe
    would block them. Raises RuntimeError with the output when the process ends first, TimeoutError when
    `timeout_s` passes."""
    if proc.stdout is None:
        raise ValueError("read_banner needs a process started with stdout=subprocess.PIPE")
    out = proc.stdout
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    router = gateway_at = None
    while router is None or (gateway and gateway_at is None):
        line = out.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited ({proc.returncode}) before it was ready:\n{''.join(lines)}")
        lines.append(line)
        if m := ROUTER_LINE.search(line):
            router = m.group(1), m.group(2)
        if m := GATEWAY_LINE.search(line):
            gateway_at = m.group(1), m.group(2)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"pdserve up not ready after {timeout_s:.0f} s:\n{''.join(lines)}")
    threading.Thread(target=lambda: lines.extend(out), daemon=True).start()
    banner = UpBanner(router=router[0], internal=router[1], lines=lines)
    if gateway_at is not None:
        banner.gateway, banner.model_name = gateway_at
    return banner


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """Ctrl-C: SIGINT, then wait up to `timeout_s` for the stack to drain and exit; past that, SIGKILL and raise
    subprocess.TimeoutExpired (a stack that does not stop is a failure)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
