"""bench/diag/grpc_hop.py on this host: both receive modes stream every message and print a row of medians."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_both_receive_modes_print_their_medians():
    cmd = [sys.executable, str(ROOT / "bench" / "diag" / "grpc_hop.py"), "--calls", "30", "--messages", "4"]
    run = subprocess.run([*cmd, "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r[0]: r[1:] for r in (line.split() for line in run.stdout.splitlines()[1:3])}
    assert set(rows) == {"spin-thread", "single-thread"}, run.stdout
    for name, row in rows.items():
        first, end, later = map(float, row)
        assert 0 < first < end and later > 0, (name, row)
    assert run.stdout.splitlines()[3].startswith("single/spin: first "), run.stdout
