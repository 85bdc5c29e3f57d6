"""bench/diag/second_token.py on this host's CPU: two variants, this tree and the same tree made a package of links
(the way another commit's tree is run), each on a stack of its own; a row of medians each, from the code named; a
variant's environment reaches its stack's services."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_each_variant_runs_on_its_own_code_and_prints_its_medians(tmp_path):
    tree = tmp_path / "tree"  # another tree: links to this one's shared/ and services/
    tree.mkdir()
    for part in ("shared", "services"):
        (tree / part).symlink_to(ROOT / part)
    cmd = [sys.executable, str(ROOT / "bench" / "diag" / "second_token.py"), "--prompt", "16", "--probes", "2"]
    run = subprocess.run([*cmd, "here", f"there={tree}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r[0]: r[1:] for r in (line.split() for line in run.stdout.splitlines()[1:])}
    assert set(rows) == {"here", "there"}, run.stdout
    for name, row in rows.items():
        first, second, gap, step = map(float, row[:4])
        assert 0 < first < second and gap > 0 and step > 0, (name, row)
    assert rows["there"][4].endswith("variant-1/pdserve"), rows  # the package of links, not the installed one
    assert "variant-" not in rows["here"][4], rows


def test_a_variants_settings_reach_its_stack():
    cmd = [sys.executable, str(ROOT / "bench" / "diag" / "second_token.py"), "--prompt", "16", "--probes", "2"]
    variants = ["g1@PDSERVE_PREFILL_KV_LAYER_GROUP=1", "bad@PDSERVE_PREFILL_KV_LAYER_GROUP=-1", "mps@PDSERVE_MPS=on"]
    run = subprocess.run([*cmd, *variants], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r[0]: r[1:] for r in (line.split() for line in run.stdout.splitlines()[1:]) if r}
    first, second = map(float, rows["g1"][:2])
    assert 0 < first < second and rows["g1"][-1] == "PDSERVE_PREFILL_KV_LAYER_GROUP=1", rows
    assert rows["bad"][0] == "failed:", run.stdout[-2000:]  # prefill refuses the setting: its stack never starts
    assert rows["mps"][0] == "failed:", run.stdout[-2000:]  # --mps on, the stack's MPS setting: no GPU is shared here
