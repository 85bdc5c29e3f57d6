"""A cluster of real processes for test_router_cluster.py (module scope): 3 prefill + 2 decode engines (tiny
model) and four routers with different settings. The engines start first on free ports (their ready files give
the addresses), then the routers with those static lists; P3 starts last and registers itself with router A.

    A  "main":      --config a.toml (static P1 P2 D1 D2); P3 registers itself with --router A
    B  admission:   prefill queue of 64 tokens per instance (TTFT budget ~0), static P1 P2 D1 D2
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
from router_testutil import wait_states

ENGINE_FLAGS = ["--torch-threads", "1", "--page-size", "16", "--max-num-seqs", "16", "--num-pages", "1024"]


@dataclass
class Cluster:
    model: Path
    work: Path
    p: list[str]  # P1 P2, then P3 once it started
    d: list[str]  # D1 D2
    routers: dict[str, str] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)  # addresses where nothing serves (router D)
    stack: Stack = field(default_factory=lambda: Stack("", [], []))
    procs: dict[str, object] = field(default_factory=dict)  # engine address or router name -> its Popen
    p3_proc: object = None

    def start_p3(self) -> None:
        """P3 registers itself with router A: first on a free port, restarted on the same one."""
        port = self.p[2].rsplit(":", 1)[1] if len(self.p) > 2 else "0"
        proc, ready, log = start_service(
            "prefill",
            ["--model", str(self.model), "--port", port, "--router", self.routers["A"].internal, *ENGINE_FLAGS],
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
    c = Cluster(model, work, [], [], dead=[f"127.0.0.1:{s.getsockname()[1]}" for s in hold])
    common = ["--model", str(model), "--log-level", "INFO"]

    def start(role: str, args: list[str]) -> tuple:
        started = start_service(role, [*common, *args], work)
        c.stack.procs.append(started[0])
        c.stack.logs.append(started[2])
        return started

    try:
        engines = [start(role, ENGINE_FLAGS) for role in ("prefill", "prefill", "decode", "decode")]  # any free port
        P1, P2, D1, D2 = addrs = [wait_ready(*s, timeout=180) for s in engines]
        c.p, c.d = [P1, P2], [D1, D2]
        c.procs = {a: s[0] for a, s in zip(addrs, engines)}
        (work / "a.toml").write_text(f'''
prefill = ["{P1}", "{P2}"]
decode = ["{D1}", "{D2}"]
estimator_store = "{work / "estimator.json"}"
[membership]
health_interval_s = 0.5
lease_s = 3.0
remove_after_s = 60.0
''')
        memory = ["--estimator-store", "memory"]
        routers = {
            "A": start("router", ["--config", str(work / "a.toml")]),
            "B": start(
                "router",
                ["--prefill", P1, "--prefill", P2, "--decode", D1, "--decode", D2, *memory]
                + ["--ttft-budget-ms", "0.00001", "--prefill-floor-tokens", "64"],
            ),
            "C": start(
                "router",
                ["--prefill", P1, "--decode", D1, "--decode", D2, *memory]
                + ["--prefill-max-inflight-tokens", "1", "--priority-aging-pcs-per-s", "1"],
            ),
            "D": start(
                "router",
                ["--prefill", P1, "--prefill", c.dead[0], "--decode", D1, "--decode", c.dead[1], *memory]
                + ["--health-interval-s", "60"],
            ),
        }
        c.procs.update((name, s[0]) for name, s in routers.items())
        c.routers = {name: wait_ready(*s, timeout=180) for name, s in routers.items()}
        c.start_p3()
        c.p.append(wait_ready(*c.p3_proc, timeout=180))
        P3 = c.p[2]
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
