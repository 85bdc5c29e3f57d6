"""CUDA MPS for engine instances that share a GPU (`pdserve up --mps`).

Without MPS, two processes on one GPU get it in turns (time slices): a burst of prefill GEMMs and a decode loop
running beside it each slow the other, a 0.5 ms decode graph to 2.96 ms and a 47 ms burst to 62 ms on an H200
(docs/benchmarks.md, "One GPU"). Under MPS their kernels share the SMs at once; with every SM open to it the
prefill's GEMMs fill them and a decode step run beside them starves (9–23 ms for the 0.5 ms graph). On a shared GPU
the decode holds its steps back while the prefill computes, within its TPOT bound (`--yield-tpot-ms`, which
`pdserve up` sets: `pdserve.engine.gpu_share`), so by default the prefill gets every SM; a share of them
(`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `--mps-prefill-sm-percent P` < 100) protects the decode steps of a stack that
turns the yield off, at the cost of the prefill's speed.

The stack runs its own control daemon (`nvidia-cuda-mps-control -f`, a child of the launcher) with a pipe and log
directory under the stack's work directory, so it never joins or stops an MPS server someone else runs; only the
engine processes on a GPU that holds both a prefill and a decode instance are its clients. Before the services
start, one CUDA client runs under it on those GPUs (`MpsDaemon.probe`): where it fails (a host that ships the binary
but cannot run MPS), "auto" goes on without MPS and says why, "on" stops. `Stack.stop` ends it (`quit`) after the
services; a launcher killed outright leaves neither behind (`mps_guard`, `pdserve.server.launcher_watch`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.cli.placement import DECODE, PREFILL, Placement

CONTROL = "nvidia-cuda-mps-control"
MODES = ("auto", "on", "off")
PIPE_ENV, LOG_ENV, SM_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# every SM: the decode's yield keeps its steps out of the prefill's way, so a cap would only slow the prefill
DEFAULT_PREFILL_SM_PERCENT = 100


def shared_gpus(plan: Sequence[Placement]) -> list[int]:
    """GPU ids that hold ranks of both a prefill and a decode instance."""
    used: dict[str, set[int]] = {PREFILL: set(), DECODE: set()}
    for p in plan:
        used.setdefault(p.role, set()).update(p.gpus)
    return sorted(used[PREFILL] & used[DECODE])


def want_mps(mode: str, plan: Sequence[Placement], environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether the stack starts its MPS daemon, and why (the line `pdserve up` prints). "on" without a shared GPU
    or without the control binary raises ValueError; "auto" is on where a GPU is shared by instances of one GPU
    each (tensor-parallel ranks talk through NCCL, not measured under MPS), the binary is on PATH and the
    environment names no MPS pipe directory of its own (someone's MPS server: its clients are theirs)."""
    if mode not in MODES:
        raise ValueError(f"--mps wants one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return False, "MPS off (--mps off)"
    gpus = shared_gpus(plan)
    binary = shutil.which(CONTROL, path=environ.get("PATH"))
    if mode == "on":
        if not gpus:
            raise ValueError("--mps on: no GPU holds both a prefill and a decode instance (MPS is for sharing one)")
        if not binary:
            raise ValueError(f"--mps on: {CONTROL} is not on PATH (it ships with the NVIDIA driver)")
        return True, f"MPS on for cuda:{','.join(map(str, gpus))} (--mps on)"
    if not gpus:
        return False, "MPS off: no GPU holds both a prefill and a decode instance"
    if any(len(p.gpus) > 1 and set(p.gpus) & set(gpus) for p in plan):
        return False, "MPS off: tensor-parallel instances share the GPUs (NCCL under MPS is not measured; --mps on)"
    if environ.get(PIPE_ENV):
        return False, f"MPS off: ${PIPE_ENV} is set (an MPS server of your own serves these processes)"
    if not binary:
        return False, f"MPS off: {CONTROL} not found"
    return True, f"MPS on for cuda:{','.join(map(str, gpus))} (prefill and decode share it; --mps off to not)"


@dataclass
class MpsDaemon:
    """One MPS control daemon of this stack (its server starts at the first client)."""

    directory: Path
    proc: subprocess.Popen  # the daemon under its guard (`mps_guard`: same output and exit code)

    def env(self) -> dict[str, str]:
        """What a client process needs to reach this daemon."""
        return _dirs(self.directory)

    @classmethod
    def start(cls, directory: Path, environ: Mapping[str, str], timeout: float = 15.0) -> MpsDaemon:
        """Start the control daemon in the foreground as a child process and wait until it answers a command;
        RuntimeError (with its log) when it exits or does not answer within `timeout` seconds."""
        for d in _dirs(directory).values():
            Path(d).mkdir(parents=True, exist_ok=True)
        out = (directory / "control.out").open("w")
        env = {**environ, **_dirs(directory)}
        env.pop(SM_ENV, None)
        guard = [sys.executable, "-m", "pdserve.cli.mps_guard", str(os.getpid()), "--"]  # quits it if we die
        proc = subprocess.Popen(
            [*guard, CONTROL, "-f"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the launcher, which stops it after the services
        )  # fmt: skip
        out.close()
        daemon = cls(directory, proc)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{CONTROL} exited with code {proc.returncode}: {daemon.log_tail()}")
            if daemon.command("get_server_list", timeout=5.0) is not None:
                return daemon
            if time.monotonic() > deadline:
                daemon.stop()
                raise RuntimeError(f"{CONTROL} did not answer within {timeout:.0f} s: {daemon.log_tail()}")
            time.sleep(0.1)

    def probe(
        self, gpus: Sequence[int], environ: Mapping[str, str], cmd: Sequence[str] = (), timeout: float = 120.0
    ) -> str:
        """Run one CUDA client on each of `gpus` through this daemon (its server starts then): "" when they ran,
        else why not. `cmd`: the client (default: a torch allocation on every GPU in `gpus`, in a child process)."""
        code = f"import torch; [torch.zeros(1, device=f'cuda:{{g}}') for g in {list(gpus)}]; torch.cuda.synchronize()"
        env = {**environ, **self.env()}
        try:
            r = subprocess.run(list(cmd) or [sys.executable, "-c", code], capture_output=True, text=True, env=env,
                               timeout=timeout)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"a CUDA client under it did not run: {e}"
        if r.returncode != 0:
            return f"a CUDA client under it exited with code {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"
        return ""

    def command(self, text: str, timeout: float = 10.0) -> str | None:
        """Send one control command; its output, or None when the daemon did not take it."""
        env = {**os.environ, **self.env()}
        try:
            r = subprocess.run([CONTROL], input=text + "\n", capture_output=True, text=True, env=env, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout if r.returncode == 0 else None

    def stop(self, timeout: float = 10.0) -> None:
        """`quit` (the server ends once its clients have), then SIGKILL after `timeout` seconds."""
        if self.proc.poll() is None:
            self.command("quit", timeout=timeout)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self) -> str:
        files = [self.directory / "control.out", *sorted((self.directory / "log").glob("*.log"))]
        return " | ".join(f.read_text()[-800:].strip() for f in files if f.exists() and f.stat().st_size)


def _dirs(directory: Path) -> dict[str, str]:
    """The daemon's pipe and log directories under `directory`, as the environment names them."""
    return {PIPE_ENV: str(directory / "pipe"), LOG_ENV: str(directory / "log")}


def client_env(p: Placement, gpus: Sequence[int], daemon: MpsDaemon | None, prefill_sm_percent: int) -> dict[str, str]:
    """The MPS environment of instance `p` (none unless it runs on one of the shared `gpus`): the daemon's
    directories, and for a prefill instance its share of the SMs."""
    if daemon is None or not set(p.gpus) & set(gpus):
        return {}
    env = daemon.env()
    if p.role == PREFILL and prefill_sm_percent < 100:
        env[SM_ENV] = str(prefill_sm_percent)
    return env
