"""`pdserve bench` as a subprocess against a real CPU stack (router + prefill + decode processes, tiny model): the
JSON (exact output lengths, no prompt-cache hits with fresh prompts, a hit when prompts repeat, the sweep, --append)
and the PNG plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.cli.launch import start_stack
from pdserve.models.checkpoints import build_checkpoint

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    model = build_checkpoint(work / "model", arch="llama", seed=0)
    s = start_stack(model, work / "stack", page_size=16, chunk_size=64, extra=["--torch-threads", "1"])
    try:
        yield s, model
    finally:
        s.stop()


def bench(stack_, *args: str) -> subprocess.CompletedProcess:
    s, model = stack_
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--target", s.router, "--tokenizer", str(model), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{s.log_text()}"
    return out


def rows(run: dict) -> list[dict]:
    cols = run["requests"]["columns"]
    return [dict(zip(cols, r)) for r in run["requests"]["rows"]]


COMMON = ["--input-dist", "uniform:20,80", "--output-dist", "uniform:2,12", "--no-progress"]


def test_bench_sweep_json_plots_append_and_cache(stack, tmp_path):
    out = tmp_path / "sweep.json"
    plots = tmp_path / "plots"
    run = bench(
        stack, "--rates", "8,4", "--num-requests", "6", "--warmup", "1", "--workers", "2", "--prompt-seed", "11",
        "--json", str(out), "--plots", str(plots), "--save-token-times", "--label", "cpu", *COMMON,
    )  # fmt: skip
    assert "highest rate with >= 90% of requests" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "pdserve.bench/1" and doc["label"] == "cpu" and "--rates 8,4" in doc["command"]
    assert doc["slo"] == {"ttft_ms": 350.0, "tpot_ms": 15.0, "attainment": 0.9}
    assert doc["workload"]["prompt_nonce"] == 11 and doc["warmup"]["requests"] == 1
    assert [r["rate"] for r in doc["runs"]] == [4.0, 8.0]  # ascending
    for r in doc["runs"]:
        s = r["summary"]
        assert s["num_requests"] == 6 and s["completed"] == 6 and s["errors"] == {}
        assert s["short_outputs"] == 0 and s["cached_prompt_tokens"] == 0  # fresh prompts: no cache hit
        reqs = rows(r)
        assert all(q["tokens"] == q["output_tokens"] and 2 <= q["tokens"] <= 12 for q in reqs)  # exact lengths
        assert all(q["ttft_ms"] > 0 and q["e2e_ms"] >= q["ttft_ms"] for q in reqs)
        assert all(len(q["chunk_ms"]) >= 1 and sum(q["chunk_tokens"]) == q["tokens"] for q in reqs)
        assert s["ttft_ms"]["count"] == 6 and s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
        assert s["goodput_rps"] == pytest.approx(s["slo_met"] / s["duration_s"])
    assert [row["rate"] for row in doc["sweep"]["rows"]] == [4.0, 8.0]
    met = [row["rate"] for row in doc["sweep"]["rows"] if row["slo_attainment"] >= 0.9]
    assert doc["sweep"]["max_rate_meeting_slo"] == (max(met) if met else None)
    for name in ("latency_cdf.png", "sweep.png"):
        assert (plots / name).read_bytes().startswith(PNG)

    # the same prompts again (same --prompt-seed and seed): the prompt cache serves their full pages
    again = tmp_path / "again.json"
    bench(stack, "--rate", "4", "--num-requests", "6", "--warmup", "0", "--workers", "1", "--prompt-seed", "11",
          "--json", str(again), *COMMON)  # fmt: skip
    assert json.loads(again.read_text())["runs"][0]["summary"]["cached_prompt_tokens"] > 0

    # default: a random nonce, so the same workload is fresh again; --append adds the run to the sweep
    bench(stack, "--concurrency", "2", "--num-requests", "4", "--warmup", "0", "--json", str(out), "--append",
          *COMMON)  # fmt: skip
    merged = json.loads(out.read_text())
    assert [(r["rate"], r["concurrency"]) for r in merged["runs"]] == [(4.0, None), (8.0, None), (None, 2)]
    assert merged["runs"][2]["summary"]["cached_prompt_tokens"] == 0 and len(merged["command"]) == 2

    # plots of several saved results, side by side
    plot = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "plot", str(out), str(again), "--labels", "a,b",
         "--out", str(tmp_path / "cmp")],  # fmt: skip
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "cmp" / "sweep.png").read_bytes().startswith(PNG)


def test_bench_rejects_lengths_beyond_the_context(stack):
    s, model = stack
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "--target", s.router, "--tokenizer", str(model),
         "--rate", "1", "--input-dist", "fixed:1000", "--output-dist", "fixed:100"],  # fmt: skip
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "context is 1024" in out.stderr
