"""bench/diag/cluster_fetch.py on this host: a 2-shard local Redis Cluster, a few repetitions, its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_script_reads_every_batch_and_prints_a_rate_per_thread_count():
    cmd = [sys.executable, str(ROOT / "bench" / "diag" / "cluster_fetch.py"), "--shards", "2", "--batch", "4"]
    cmd += ["--threads", "1,2", "--reps", "3"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines()[1:]]
    assert [r[:2] for r in rows] == [["1", "4"], ["2", "4"]]  # threads, batch (each batch's lengths are asserted)
    assert all(float(r[2]) > 0 for r in rows)  # GB/s
