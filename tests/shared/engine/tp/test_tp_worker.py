"""The rank runtime: step plans as int64 messages (round trip, and malformed ones refused), and a TP group whose rank
dies: the other ranks' collectives fail and they exit within a timeout (no rank left running)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pdserve.engine.tp.worker import STEP, StepPlan
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.tp_ranks import idle_rank, kill_all, spawn_ranks
from pdserve.testing.wait import wait_until

PLAN = StepPlan([5, 6, 7, 8], [0, 9], [3, 1], [[4], [0, 2, 3]], 0, [2, 3])


def test_plan_round_trip():
    msg = PLAN.encode()
    assert msg.dtype == torch.int64 and int(msg[0]) == STEP
    assert StepPlan.decode(msg, vocab_size=16, num_pages=8) == PLAN


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m[:-1], "does not match its header"),
        (lambda m: torch.cat([m, m[:1]]), "does not match its header"),
        (lambda m: m.index_fill(0, torch.tensor([11]), 99), "outside the model's vocabulary"),  # a token id
        (lambda m: m.index_fill(0, torch.tensor([16]), 8), "outside the model's vocabulary / the pool"),  # a page
        (lambda m: m.index_fill(0, torch.tensor([3]), 3), "bad plan header"),  # num_decode > sequences
        (lambda m: m.index_fill(0, torch.tensor([0]), 7), "not a STEP message"),
    ],
)
def test_malformed_plan_refused(edit, match):
    with pytest.raises(ValueError, match=match):
        StepPlan.decode(edit(PLAN.encode()), vocab_size=16, num_pages=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)  # 6 heads: 3 ranks
    return build_checkpoint(tmp_path_factory.mktemp("tp_worker") / "model", arch="llama", **shape)


@pytest.mark.parametrize("victim", [1, 0], ids=["follower_dies", "leader_dies"])
def test_rank_death_ends_the_group(model_dir, tmp_path, victim):
    world = 3
    ctx = spawn_ranks(idle_rank, world, (str(tmp_path / "rendezvous"), model_dir, tmp_path), join=False)
    try:
        procs = ctx.processes
        ready = lambda: all((tmp_path / f"ready{r}").exists() for r in range(world))  # noqa: E731
        wait_until(lambda: ready() or any(p.exitcode is not None for p in procs), timeout=120, what="ranks up")
        assert ready(), f"a rank ended before the group was up: exit codes {[p.exitcode for p in procs]}"
        os.kill(procs[victim].pid, signal.SIGKILL)
        start = time.monotonic()
        others = [p for r, p in enumerate(procs) if r != victim]
        for p in others:
            p.join(timeout=max(0.1, 45 - (time.monotonic() - start)))
        assert not any(p.is_alive() for p in others), "a rank outlived the dead one by 45 s"
        assert all(p.exitcode != 0 for p in others)  # ended by the failed collective, not a clean return
    finally:
        kill_all(ctx)


CHILD = """
import sys, time
from pdserve.engine.tp.worker import exit_with_parent
exit_with_parent(poll_s=0.05)
print("ready", flush=True)
time.sleep(600)
"""
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_rank_exits_with_its_parent():
    """A rank (the child) whose instance (the parent) is SIGKILLed ends by itself: no orphan."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _running(child_pid)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not _running(child_pid), timeout=30, what="the orphaned rank to exit")
    finally:
        parent.kill()
        if child_pid and _running(child_pid):
            os.kill(child_pid, signal.SIGKILL)
