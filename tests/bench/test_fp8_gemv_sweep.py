"""bench/fp8_gemv_sweep.py: its --smoke run in Triton's interpreter on CPU (every FP8 GEMV path's first configs
against the dequantized reference, the tables and the JSON), and the compile chunking and best-row choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fp8_gemv_sweep import SMOKE, best_rows, compile_chunks

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_every_path_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    from pdserve.engine.quant.fp8_gemv import PATH_CONFIGS, PATH_MAX_ROWS

    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "bench/fp8_gemv_sweep.py"), "--smoke", "--json", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    best = json.loads(out.read_text())["best"]
    want = {(p, m, s) for p in PATH_CONFIGS for m in (1, 3) if m <= PATH_MAX_ROWS[p] for s in SMOKE["tiny"]}
    assert {(b["path"], b["m"], b["shape"]) for b in best} == want
    assert all(b["max_rel_err"] < 1e-5 for b in best)
    assert "best config per (path, M, shape)" in r.stdout


def test_compile_chunks_keep_one_specialization_together():
    cfgs = [dict(block_n=16), dict(block_n=32)]
    jobs = [("dot", c, m, n, 4096, pdl) for c in cfgs for m in (1, 2, 3, 4, 16) for n in (4096, 6144)
            for pdl in (True, False)]  # fmt: skip
    chunks = compile_chunks(jobs, 5)
    assert len(chunks) == 5 and sorted(map(str, sum(chunks, []))) == sorted(map(str, jobs))
    where = {}
    for i, chunk in enumerate(chunks):
        for _, cfg, m, _, _, pdl in chunk:
            key = (cfg["block_n"], pdl, 1 << (m - 1).bit_length(), m == 1)
            assert where.setdefault(key, i) == i, key  # M = 3 and 4 share BLOCK_M 4: one worker
    assert len(compile_chunks([jobs[0], jobs[2]], 16)) == 1  # one specialization (two shapes): one worker


def test_best_rows_take_the_fastest_config_per_key():
    rows = [dict(path="dot", m=1, model="8b", shape="o", config={"block_n": b}, us=us) for b, us in ((16, 9.0),
            (32, 7.0), (64, 8.0))] + [dict(path="fma", m=1, model="8b", shape="o", config={}, us=20.0)]  # fmt: skip
    best = {b["path"]: b for b in best_rows(rows)}
    assert best["dot"]["config"] == {"block_n": 32} and best["fma"]["us"] == 20.0 and len(best) == 2
