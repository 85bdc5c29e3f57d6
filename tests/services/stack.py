"""Start real router/prefill/decode processes for end-to-end tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stack:
    router: str
    prefill: list[str]
    decode: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    def log_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in self.logs if p.exists())


def start_service(name: str, args: list[str], workdir: Path, env: dict | None = None) -> tuple[subprocess.Popen, Path, Path]:
    idx = len(list(workdir.glob(f"{name}*.log")))
    ready = workdir / f"{name}{idx}.json"
    log = workdir / f"{name}{idx}.log"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", name, "--ready-file", str(ready), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, ready, log


def wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"service exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"service not ready:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    return json.loads(ready.read_text())["address"]


def start_stack(model: Path, workdir: Path, kv_dtype: str = "auto", page_size: int = 4, chunk_size: int = 8,
                num_prefill: int = 1, num_decode: int = 1, extra: list[str] = ()) -> Stack:
    workdir.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(model), "--page-size", str(page_size), "--chunk-size", str(chunk_size),
              "--kv-dtype", kv_dtype, "--num-pages", "512", *extra]
    started = [start_service("prefill", common, workdir) for _ in range(num_prefill)]
    started += [start_service("decode", common, workdir) for _ in range(num_decode)]
    procs = [s[0] for s in started]
    logs = [s[2] for s in started]
    try:
        addrs = [wait_ready(*s) for s in started]
        pre, dec = addrs[:num_prefill], addrs[num_prefill:]
        rargs = ["--model", str(model)] + sum((["--prefill", a] for a in pre), []) + sum((["--decode", a] for a in dec), [])
        r = start_service("router", rargs, workdir)
        procs.append(r[0])
        logs.append(r[2])
        router = wait_ready(*r)
    except Exception:
        Stack("", [], [], procs, logs).stop()
        raise
    return Stack(router, pre, dec, procs, logs)
