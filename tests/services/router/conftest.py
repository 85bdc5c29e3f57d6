"""A cluster of real processes for test_router_cluster.py (module scope): 3 prefill + 2 decode engines (tiny
model) and four routers with different settings, all started at once (engine ports are picked up front so the
routers' static lists are known before the engines are up; the routers see them come up through their health
checks).

    A  "main":      --config a.toml (static P1 P2 D1 D2); P3 registers itself with --router A
    B  admission:   decode capacity 100 PCS (budget 80), static P1 P2 D1 D2
    C  priority:    one prefill (P1), at most one request in prefill at a time, static D1 D2, slow aging
    D  retry:       static lists with a dead prefill and a dead decode address next to P1 / D1
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.cli.launch import Stack, start_service, wait_ready
from pdserve.models.checkpoints import build_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from router_testutil import free_port, wait_states

ENGINE_FLAGS = ["--torch-threads", "1", "--page-size", "16", "--max-num-seqs", "16", "--num-pages", "1024"]


@dataclass
class Cluster:
    model: Path
    work: Path
    p: list[str]  # P1 P2 P3
    d: list[str]  # D1 D2
    routers: dict[str, str] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)  # addresses where nothing serves (router D)
    stack: Stack = field(default_factory=lambda: Stack("", [], []))
    procs: dict[str, object] = field(default_factory=dict)  # engine address -> its Popen
    p3_proc: object = None

    def start_p3(self) -> None:
        port = self.p[2].rsplit(":", 1)[1]
        proc, ready, log = start_service(
            "prefill",
            ["--model", str(self.model), "--port", port, "--router", self.routers["A"], *ENGINE_FLAGS],
            self.work,
        )
        self.stack.procs.append(proc)
        self.stack.logs.append(log)
        self.p3_proc = (proc, ready, log)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    work = tmp_path_factory.mktemp("router-cluster")
    model = build_checkpoint(work / "model", arch="llama", seed=3)
    hold = [socket.socket() for _ in range(2)]  # bound, never listening: connections are refused
    for s in hold:
        s.bind(("127.0.0.1", 0))
    c = Cluster(
        model,
        work,
        [f"127.0.0.1:{free_port()}" for _ in range(3)],
        [f"127.0.0.1:{free_port()}" for _ in range(2)],
        dead=[f"127.0.0.1:{s.getsockname()[1]}" for s in hold],
    )
    P1, P2, P3 = c.p
    D1, D2 = c.d
    (work / "a.toml").write_text(f'''
prefill = ["{P1}", "{P2}"]
decode = ["{D1}", "{D2}"]
estimator_store = "{work / "estimator.json"}"
[membership]
health_interval_s = 0.5
lease_s = 3.0
remove_after_s = 60.0
''')
    common = ["--model", str(model), "--log-level", "INFO"]
    started = []
    try:
        for name, extra in {
            "A": ["--config", str(work / "a.toml")],
            "B": [
                "--prefill",
                P1,
                "--prefill",
                P2,
                "--decode",
                D1,
                "--decode",
                D2,
                "--estimator-store",
                "memory",
                "--prefill-capacity-pcs",
                "100000",
                "--decode-capacity-pcs",
                "100",
            ],
            "C": [
                "--prefill",
                P1,
                "--decode",
                D1,
                "--decode",
                D2,
                "--estimator-store",
                "memory",
                "--prefill-max-inflight-tokens",
                "1",
                "--priority-aging-pcs-per-s",
                "1",
            ],
            "D": [
                "--prefill",
                P1,
                "--prefill",
                c.dead[0],
                "--decode",
                D1,
                "--decode",
                c.dead[1],
                "--estimator-store",
                "memory",
                "--health-interval-s",
                "60",
            ],
        }.items():
            started.append((name, start_service("router", [*common, *extra], work)))
        for role, addr in [("prefill", P1), ("prefill", P2), ("decode", D1), ("decode", D2)]:
            started.append(
                (addr, start_service(role, [*common, "--port", addr.rsplit(":", 1)[1], *ENGINE_FLAGS], work))
            )
        c.stack.procs.extend(s[1][0] for s in started)
        c.procs = {name: s[0] for name, s in started}
        c.stack.logs.extend(s[1][2] for s in started)
        for name, s in started:
            addr = wait_ready(*s, timeout=180)
            if name in ("A", "B", "C", "D"):
                c.routers[name] = addr
        c.start_p3()
        wait_ready(*c.p3_proc, timeout=180)
        wait_states(c.routers["A"], {P1: "up", P2: "up", P3: "up", D1: "up", D2: "up"})
        wait_states(c.routers["B"], {P1: "up", P2: "up", D1: "up", D2: "up"})
        wait_states(c.routers["C"], {P1: "up", D1: "up", D2: "up"})
    except BaseException:
        c.stack.stop()
        print(c.stack.log_text())
        raise
    yield c
    c.stack.stop()
    for s in hold:
        s.close()
