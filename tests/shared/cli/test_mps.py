"""`pdserve up --mps`: which GPUs get the stack's MPS daemon, the client environment of each instance, and the
daemon's life (started, answering, quit with the stack) against a stand-in `nvidia-cuda-mps-control` (CPU)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli.launch import Stack, plan_placement
from pdserve.cli.mps import CONTROL, PIPE_ENV, SM_ENV, MpsDaemon, client_env, shared_gpus, want_mps
from pdserve.testing.wait import wait_until

# answers commands only once its foreground daemon runs (as the real one: a pipe in the pipe directory)
FAKE_CONTROL = """#!{python}
import os, pathlib, sys, time
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("cannot start: no device"); sys.exit(3)
    (pipe / "pid").write_text(str(os.getpid()))
    (pipe / "control").write_text("up")
    while not (pipe / "quit").exists():
        time.sleep(0.02)
    sys.exit(0)
if not (pipe / "control").exists():
    sys.exit(1)
cmd = sys.stdin.read().strip()
with open(pipe / "commands", "a") as f:
    f.write(cmd + chr(10))
if cmd == "quit":
    (pipe / "quit").write_text("")
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / CONTROL
    exe.write_text(FAKE_CONTROL.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    return exe


def test_only_a_gpu_that_prefill_and_decode_share_is_shared():
    assert shared_gpus(plan_placement(1, 1, [0], 0.9)) == [0]
    assert shared_gpus(plan_placement(1, 1, [0, 1], 0.9)) == []  # a GPU each
    assert shared_gpus(plan_placement(2, 2, [0, 1, 2], 0.9)) == []  # prefill on 0 and 1, both decode on 2
    assert shared_gpus(plan_placement(0, 1, [0], 0.9)) == []  # colocated: decode-placed only
    assert shared_gpus(plan_placement(1, 1, [], 0.9)) == []  # no placement


def test_want_mps_auto_on_off(fake_control):
    one, two = plan_placement(1, 1, [0], 0.9), plan_placement(1, 1, [0, 1], 0.9)
    env = dict(os.environ)
    assert want_mps("auto", one, env)[0] and "cuda:0" in want_mps("auto", one, env)[1]
    assert want_mps("auto", two, env) == (False, "MPS off: no GPU holds both a prefill and a decode instance")
    assert not want_mps("auto", one, {**env, PIPE_ENV: "/somewhere"})[0]  # someone's own MPS server
    assert not want_mps("auto", one, {**env, "PATH": "/nonexistent"})[0]
    assert want_mps("off", one, env) == (False, "MPS off (--mps off)")
    tp = plan_placement(1, 1, [0, 1], 0.9, 2, 2)  # both instances on GPUs 0 and 1
    assert want_mps("auto", tp, env) == (
        False,
        "MPS off: tensor-parallel instances share the GPUs (NCCL under MPS is not measured; --mps on)",
    )
    assert want_mps("on", tp, env)[0]
    assert want_mps("on", one, env)[0]
    with pytest.raises(ValueError, match="no GPU holds both"):
        want_mps("on", two, env)
    with pytest.raises(ValueError, match="not on PATH"):
        want_mps("on", one, {**env, "PATH": "/nonexistent"})
    with pytest.raises(ValueError, match="--mps wants one of"):
        want_mps("yes", one, env)


def test_daemon_answers_gives_clients_their_env_and_quits(fake_control, tmp_path):
    daemon = MpsDaemon.start(tmp_path / "mps", os.environ)
    try:
        assert daemon.proc.poll() is None
        assert daemon.env()[PIPE_ENV] == str(tmp_path / "mps" / "pipe")
        plan = plan_placement(1, 1, [0], 0.9)
        pre, dec = (next(p for p in plan if p.role == r) for r in ("prefill", "decode"))
        assert client_env(pre, [0], daemon, 80) == {**daemon.env(), SM_ENV: "80"}
        assert client_env(dec, [0], daemon, 80) == daemon.env()  # decode keeps every SM
        assert client_env(pre, [0], daemon, 100) == daemon.env()
        assert client_env(pre, [], daemon, 80) == {} and client_env(pre, [0], None, 80) == {}
    finally:
        Stack("", [], [], cleanup=[daemon.stop]).stop()  # the stack's stop ends it after its processes
    assert daemon.proc.returncode == 0
    commands = (tmp_path / "mps" / "pipe" / "commands").read_text().split()
    assert commands[0] == "get_server_list" and commands[-1] == "quit"


def test_a_daemon_that_cannot_start_is_an_error_with_its_output(fake_control, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(RuntimeError, match="exited with code 3: cannot start: no device"):
        MpsDaemon.start(tmp_path / "mps", os.environ)


def test_up_prints_the_mps_choice_and_refuses_on_without_a_shared_gpu(fake_control):
    up = [sys.executable, "-m", "pdserve.cli", "up", "--model", "m", "--print-plan", "--disaggregated"]
    res = subprocess.run([*up, "--gpus", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "pdserve up: MPS on for cuda:0 (prefill and decode share it; --mps off to not)" in res.stdout
    res = subprocess.run([*up, "--gpus", "0", "--mps", "off"], capture_output=True, text=True, timeout=120)
    assert "pdserve up: MPS off (--mps off)" in res.stdout
    res = subprocess.run([*up, "--gpus", "0,1", "--mps", "on"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--mps on: no GPU holds both a prefill and a decode instance" in res.stderr
    res = subprocess.run([*up, "--gpus", "0", "--mps-prefill-sm-percent", "0"], capture_output=True, text=True)
    assert res.returncode == 2 and "--mps-prefill-sm-percent wants 1..100" in res.stderr


def test_probe_runs_a_client_under_the_daemon(fake_control, tmp_path):
    daemon = MpsDaemon.start(tmp_path / "mps", os.environ)
    try:
        sees_pipe = "import os, sys; sys.exit(0 if os.environ.get('CUDA_MPS_PIPE_DIRECTORY') else 5)"
        assert daemon.probe([0], os.environ, cmd=[sys.executable, "-c", sees_pipe]) == ""
        fails = "import sys; print('no MPS server'); sys.exit(7)"
        assert daemon.probe([0], os.environ, cmd=[sys.executable, "-c", fails]) == (
            "a CUDA client under it exited with code 7: no MPS server"
        )
    finally:
        daemon.stop()


@pytest.mark.parametrize("probe_ok", [True, False])
def test_start_mps_goes_on_without_mps_where_auto_cannot_run_a_client(fake_control, tmp_path, monkeypatch, capsys,
                                                                      probe_ok):  # fmt: skip
    from pdserve.cli.launch import start_mps

    started: list[MpsDaemon] = []

    def probe(self, gpus, environ, cmd=(), timeout=120.0):
        started.append(self)
        return "" if probe_ok else "a CUDA client under it exited with code 1: MPS unsupported"

    monkeypatch.setattr(MpsDaemon, "probe", probe)
    plan = plan_placement(1, 1, [0], 0.9)
    daemon = start_mps("auto", plan, [0], tmp_path, dict(os.environ))
    if probe_ok:
        assert daemon is started[0] and daemon.proc.poll() is None
        daemon.stop()
    else:
        assert daemon is None and started[0].proc.poll() == 0  # stopped again
        assert "pdserve up: MPS off: a CUDA client under it exited with code 1" in capsys.readouterr().err
        with pytest.raises(RuntimeError, match="--mps on: a CUDA client under it exited with code 1"):
            start_mps("on", plan, [0], tmp_path / "on", dict(os.environ))
        assert started[1].proc.poll() == 0
    assert start_mps("off", plan, [0], tmp_path, dict(os.environ)) is None


def running(pid: int) -> bool:
    """Not gone and not a zombie (an orphan's reaper may be slow)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


LAUNCHER = """
import os, sys
from pathlib import Path
from pdserve.cli.mps import MpsDaemon
daemon = MpsDaemon.start(Path(sys.argv[1]), os.environ)
print(daemon.proc.pid, flush=True)
sys.stdin.read()  # until the test kills this launcher
"""


def test_a_launcher_killed_outright_leaves_no_daemon(fake_control, tmp_path):
    """SIGKILL to the launcher: its guard (`mps_guard`) sends the daemon `quit`, as `Stack.stop` would have."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "mps")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    pipe = tmp_path / "mps" / "pipe"
    try:
        guard = int(launcher.stdout.readline())  # type: ignore[union-attr]
        daemon = int((pipe / "pid").read_text())
        assert running(guard) and running(daemon) and guard != daemon
        launcher.kill()
        launcher.wait(10)
        wait_until(lambda: not running(daemon) and not running(guard), timeout=30, what="the daemon to quit")
        assert (pipe / "commands").read_text().split()[-1] == "quit"
        assert "the launcher (pid" in (tmp_path / "mps" / "control.out").read_text()
    finally:
        launcher.kill()


def test_a_killed_guard_takes_its_daemon_along(fake_control, tmp_path):
    daemon = MpsDaemon.start(tmp_path / "mps", os.environ)
    pid = int((tmp_path / "mps" / "pipe" / "pid").read_text())
    assert running(pid)
    daemon.proc.send_signal(signal.SIGKILL)  # the guard
    daemon.proc.wait(10)
    wait_until(lambda: not running(pid), timeout=30, what="the daemon to die with its guard (PR_SET_PDEATHSIG)")


def test_instances_on_a_shared_gpu_get_one_share_file_per_gpu(tmp_path):
    """pdserve.engine.gpu_share's file: the prefill and decode of a shared GPU name the same one, by role; an
    instance alone on its GPU, or spread over several (tensor parallel), none."""
    from pdserve.cli.launch import gpu_share_env

    plan = [*plan_placement(1, 1, [0], 0.9), *plan_placement(2, 2, [0, 1, 2], 0.9)]
    shared = [0]
    envs = [gpu_share_env(p, shared, tmp_path) for p in plan]
    for p, got in zip(plan, envs):
        if p.gpus[0] in shared:
            yield_env = {"PDSERVE_DECODE_YIELD_TPOT_MS": "13"} if p.role == "decode" else {}  # 13/15 of the SLO
            assert got == {f"PDSERVE_{p.role.upper()}_GPU_SHARE_FILE": str(tmp_path / f"gpu-share-{p.gpus[0]}"),
                           **yield_env}  # fmt: skip
        else:
            assert got == {}
    assert envs[0] and envs[1] and envs[0] != envs[1]  # the shared GPU's prefill and decode: one file, two names
    tp = plan_placement(1, 1, [0, 1], 0.9, 2, 2)
    assert all(gpu_share_env(p, shared_gpus(tp), tmp_path) == {} for p in tp)


def test_the_decode_yield_follows_the_routers_tpot_slo(tmp_path):
    """The decode of a shared GPU holds its steps back within 13/15 of the router's TPOT SLO, resolved as the router
    resolves it: its flag, its environment, its config file, its default (a configuration it refuses: the default)."""
    from pdserve.cli.launch import ROUTER_TPOT_SLO_MS, decode_yield_line, gpu_share_env, router_tpot_slo_ms
    from pdserve.router.config import RouterConfig

    assert RouterConfig(model="m").slo_tpot_ms == ROUTER_TPOT_SLO_MS
    assert router_tpot_slo_ms([], {}) == 15.0
    assert router_tpot_slo_ms(["--log-level", "info", "--slo-tpot-ms", "30"], {}) == 30.0
    assert router_tpot_slo_ms(["--slo-tpot-ms=45"], {"PDSERVE_ROUTER_SLO_TPOT_MS": "60"}) == 45.0
    assert router_tpot_slo_ms([], {"PDSERVE_ROUTER_SLO_TPOT_MS": "60"}) == 60.0
    (tmp_path / "router.toml").write_text("slo_tpot_ms = 40\n")
    assert router_tpot_slo_ms(["--config", str(tmp_path / "router.toml")], {}) == 40.0
    assert router_tpot_slo_ms(["--slo-tpot-ms", "many"], {}) == ROUTER_TPOT_SLO_MS
    line = decode_yield_line(["--slo-tpot-ms", "30"], {}, "m")  # what `pdserve up` prints on a shared GPU
    assert "within 26 ms (13/15 of the router's TPOT SLO of 30 ms" in line
    assert decode_yield_line([], {"PDSERVE_DECODE_YIELD_TPOT_MS": "0"}, "m").startswith("decode does not yield")
    decode = [p for p in plan_placement(1, 1, [0], 0.9) if p.role == "decode"][0]
    assert gpu_share_env(decode, [0], tmp_path, 30.0)["PDSERVE_DECODE_YIELD_TPOT_MS"] == "26"
    given = gpu_share_env(decode, [0], tmp_path, 30.0, {"PDSERVE_DECODE_YIELD_TPOT_MS": "0"})  # the user's wins
    assert "PDSERVE_DECODE_YIELD_TPOT_MS" not in given and "PDSERVE_DECODE_GPU_SHARE_FILE" in given
