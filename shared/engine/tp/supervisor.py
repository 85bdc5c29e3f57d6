"""Rank 0 of a tensor-parallel instance: start ranks 1..N-1 as child processes (`pdserve.engine.tp.follower`),
join the group with them, and keep the group whole.

- Start: each follower is `python -m pdserve.engine.tp.follower` with the engine config as JSON (no pickle), its
  rank, the `file://` rendezvous (a private temp dir: no port) and this process's pid; on a GPU rank r runs on
  cuda:<index + r> (the instance's own device is rank 0's), on CPU on gloo.
- While the instance runs: a watcher thread ends the instance (`fatal`: kill the followers, `os._exit(1)`) as soon
  as a follower process exits, and once `lead` handed it the rank runtime, heartbeats idle time (an IDLE broadcast
  whenever no step held the group for `heartbeat_s`) so followers never reach their collective timeout. Every
  broadcast of the engine thread goes through `guard`: a failed collective (a rank died mid-step) is fatal too, so
  the router sees the instance gone and fails its streams over.
- Followers die with this process (a parent watch on their side, `follower.die_with_parent`); a clean exit of
  rank 0 (`stop`, at interpreter exit) sends SHUTDOWN first.
- Observability is rank 0's: it serves Stats and /metrics (with the TP size) and exports the traces, one span per
  instance step; followers run with tracing off (OTEL_SDK_DISABLED) and serve nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from pdserve.engine.tp.comm import DEFAULT_TIMEOUT_S, TPGroup

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.tp.worker import PlanLeader

log = logging.getLogger("pdserve.engine.tp")

HEARTBEAT_S = 1.0  # idle broadcast period (well under the group timeout)
WATCH_POLL_S = 0.1  # follower liveness poll
FATAL_EXIT_CODE = 17  # rank 0's exit code when its group broke (a rank died or a collective failed)


def rank_device(device: torch.device, rank: int) -> str:
    """The device string of `rank` when rank 0 runs on `device`: cuda:<index + rank> on a GPU, else cpu."""
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        if index + rank >= torch.cuda.device_count():
            raise ValueError(
                f"tensor parallel rank {rank} would run on cuda:{index + rank}, but only "
                f"{torch.cuda.device_count()} CUDA devices are visible"
            )
        return f"cuda:{index + rank}"
    return "cpu"


class RankSupervisor:
    """Rank 0's followers and the group they form with it (`start`)."""

    def __init__(self, followers: list[subprocess.Popen], workdir: str, heartbeat_s: float):
        self.followers, self._workdir, self.heartbeat_s = followers, workdir, heartbeat_s
        self.group: TPGroup | None = None  # set once every rank joined (`start`)
        self._lock = threading.Lock()  # one broadcast at a time: the engine thread's steps, the heartbeat
        self._leader: PlanLeader | None = None
        self._last_use = time.monotonic()
        self._stopping = threading.Event()

    @classmethod
    def start(
        cls,
        cfg: EngineConfig,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> RankSupervisor:
        """Start ranks 1..N-1 of `cfg.tensor_parallel_size` and join the group as rank 0 (returns once every rank
        joined; a follower exiting first ends this process)."""
        world = cfg.tensor_parallel_size
        workdir = tempfile.mkdtemp(prefix="pdserve-tp-")
        init = f"file://{os.path.join(workdir, 'rendezvous')}"
        followers = []
        for r in range(1, world):
            rank_cfg = dataclasses.replace(cfg, device=rank_device(device, r))
            cmd = [sys.executable, "-m", "pdserve.engine.tp.follower", "--rank", str(r), "--world", str(world)]
            cmd += ["--init", init, "--parent", str(os.getpid()), "--timeout-s", str(timeout_s)]
            cmd += ["--torch-threads", str(torch.get_num_threads())]
            env = {**os.environ, "PDSERVE_TP_ENGINE_CONFIG": json.dumps(dataclasses.asdict(rank_cfg))}
            env["OTEL_SDK_DISABLED"] = "true"  # an instance step is one span, rank 0's: a follower exports none
            followers.append(subprocess.Popen(cmd, env=env))
        log.info("tensor parallel: started ranks 1..%d (pids %s)", world - 1, [p.pid for p in followers])
        sup = cls(followers, workdir, heartbeat_s)
        threading.Thread(target=sup._watch_followers, name="tp-rank-watch", daemon=True).start()
        try:
            sup.group = TPGroup.init(0, world, init, device, timeout_s)
        except BaseException:
            sup.stop(timeout_s=0.0)  # no follower outlives a failed start
            raise
        atexit.register(sup.stop)
        log.info("tensor parallel: group of %d ranks up (%s)", world, "nccl" if device.type == "cuda" else "gloo")
        return sup

    def lead(self, leader: PlanLeader) -> None:
        """Hand over rank 0's runtime: from now on idle time is heartbeated."""
        self._leader = leader
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold the group for one broadcast and what follows it (a forward, a logits block, a page copy); any error
        inside leaves the ranks out of step: fatal."""
        with self._lock:
            try:
                yield
            except BaseException as e:
                self.fatal(f"a tensor-parallel step failed ({type(e).__name__}: {e})")
            finally:
                self._last_use = time.monotonic()

    def fatal(self, why: str) -> None:
        """End the instance now: kill every follower, exit non-zero (the router fails the streams over)."""
        log.critical("tensor parallel: %s; ending the instance", why)
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        self._kill_followers()
        shutil.rmtree(self._workdir, ignore_errors=True)
        os._exit(FATAL_EXIT_CODE)

    def stop(self, timeout_s: float = 5.0) -> None:
        """A clean end (interpreter exit): SHUTDOWN to the followers, wait for them, kill any left."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._leader is not None and self._lock.acquire(timeout=timeout_s):
            try:
                self._leader.shutdown()
            except Exception:
                pass
            finally:
                self._lock.release()
        deadline = time.monotonic() + timeout_s
        for p in self.followers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        self._kill_followers()
        if self.group is not None:  # one TP group per process: a later instance in this process may form its own
            with contextlib.suppress(Exception):
                self.group.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    # ---- threads ---------------------------------------------------------------------------------------------
    def _watch_followers(self) -> None:
        while not self._stopping.is_set():
            for r, p in enumerate(self.followers, start=1):
                code = p.poll()
                if code is not None and not self._stopping.is_set():
                    self.fatal(f"rank {r} (pid {p.pid}) exited with code {code}")
            time.sleep(WATCH_POLL_S)

    def _heartbeat(self) -> None:
        while not self._stopping.wait(self.heartbeat_s / 4):
            if time.monotonic() - self._last_use < self.heartbeat_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._stopping.is_set():
                    return
                assert self._leader is not None
                self._leader.idle()
                self._last_use = time.monotonic()
            except BaseException as e:
                self.fatal(f"heartbeat failed ({type(e).__name__}: {e})")
            finally:
                self._lock.release()

    def _kill_followers(self) -> None:
        for p in self.followers:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.followers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
