"""bench/one_gpu.py: the goodput ceiling's formula against closed forms, and the script itself on CPU with a tiny
model and a tiny load (both `pdserve up` modes, `pdserve bench`, the mode data file and `default_mode`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from one_gpu import KEYS, entry_name, goodput_limit, redis_fetch_gbps, step_at, tpot_at

from pdserve.cli.mode_choice import choose_mode, load_measurements
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
STEPS = {1: 5.0, 4: 5.2, 8: 5.5, 16: 6.0, 24: 6.5, 32: 7.0, 48: 8.0}  # ms: the shape of an 8B int8 decode step


def test_step_time_is_linear_between_measured_batches():
    assert step_at(STEPS, 0.5) == 5.0 and step_at(STEPS, 16) == 6.0
    assert step_at(STEPS, 20) == pytest.approx(6.25) and step_at(STEPS, 64) == pytest.approx(9.0)  # extrapolated
    assert step_at({8: 4.0}, 100) == 4.0


def test_a_constant_step_gives_the_closed_form_ceiling():
    """TPOT = step / (1 - rate * P) <= SLO  =>  rate <= (1 - step / SLO) / P."""
    assert goodput_limit(47.0, {1: 6.0}) == pytest.approx((1 - 6 / 15) / 0.047, rel=1e-6)
    assert tpot_at(10.0, 47.0, {1: 6.0}, 128, 1e9) == pytest.approx(6 / (1 - 0.47))


def test_the_ceiling_is_where_the_fixed_point_tpot_meets_the_slo():
    limit = goodput_limit(47.0, STEPS, output_tokens=128, slo_tpot_ms=15.0)
    assert 10.0 < limit < 13.0  # the estimate: about 10-11 req/s
    tpot = tpot_at(limit * 0.999, 47.0, STEPS, 128, 1e9)
    batch = limit * 0.999 * 127 * tpot / 1e3  # Little: requests in decode
    assert tpot == pytest.approx(step_at(STEPS, batch) / (1 - limit * 0.999 * 0.047), rel=1e-4)
    assert tpot == pytest.approx(15.0, rel=0.01)
    assert math.isinf(tpot_at(limit * 1.01, 47.0, STEPS, 128, 15.0))  # past it the fixed point passes the SLO
    assert goodput_limit(47.0, STEPS, output_tokens=512) < limit  # longer outputs: a larger batch, slower steps


def test_the_ttft_bound_binds_when_prefill_is_long():
    """TTFT = P + rho P / (2 (1 - rho)) <= 350 ms with P = 300 ms: rho <= 0.25, 0.833 req/s."""
    assert goodput_limit(300.0, {1: 1.0}, slo_ttft_ms=350.0) == pytest.approx(0.25 / 0.3, rel=1e-6)
    assert goodput_limit(400.0, {1: 1.0}) == 0.0  # a prefill alone misses the SLO


def test_the_redis_fetch_rate_reads_every_value_back(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        rate = redis_fetch_gbps(redis.url, page_bytes=4096, pages=16, reps=3)
        client = redis.client()
        assert client.dbsize() == 16 and all(len(client.get(f"one_gpu-{i}")) == 4096 for i in range(16))
    finally:
        redis.stop()
    assert 0 < rate < 1e3  # GB/s


@pytest.mark.timeout(240)
def test_repeated_disaggregated_runs_each_keep_their_details():
    details: dict = {}
    for mps, y in [("auto", ""), ("on:100", ""), ("auto", ""), ("auto", "13"), ("auto", "13")]:
        details[entry_name(details, mps, y)] = {}
    assert list(details) == ["disagg1_mps_auto", "disagg1_mps_on_100", "disagg1_mps_auto_run2",
                             "disagg1_mps_auto_yield_13", "disagg1_mps_auto_yield_13_run2"]  # fmt: skip


def test_the_script_on_cpu_merges_its_part_and_writes_the_mode_data(tmp_path):
    """One stack (`pdserve up --disaggregated`, ~30 s on CPU); the colocated part comes from an earlier call into
    the same JSON, as parts run in separate calls do."""
    model = build_checkpoint(tmp_path / "tiny", arch="llama", seed=1)
    out, mode_data = tmp_path / "one_gpu.json", tmp_path / "mode_choice.json"
    earlier = {"coloc_goodput_rps": 2.0, "coloc_ttft_ms_p50_2rps": 1e4, "raw_grpc_gbps": 1.5}
    earlier["details"] = {"coloc": {"slo": {"ttft_ms": 5000.0, "tpot_ms": 150.0, "attainment": 0.9}}}
    out.write_text(json.dumps(earlier))
    cmd = [sys.executable, str(ROOT / "bench" / "one_gpu.py"), "--part", "disagg", "--gpus", "none"]
    cmd += ["--model", str(model), "--rates", "2", "--num-requests", "3", "--prompt-tokens", "32"]
    cmd += ["--output-tokens", "8", "--slo-preset", "cpu", "--json", str(out), "--mode-data", str(mode_data)]
    cmd += ["--workdir", str(tmp_path / "work")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc) - {"details"} <= set(KEYS) and {"date", "commit", "device"} <= set(doc)
    assert doc["raw_grpc_gbps"] == 1.5 and "coloc" in doc["details"]  # the earlier part's keys kept
    assert doc["disagg1_goodput_rps"] in (0.0, 2.0) and doc["disagg1_ttft_ms_p50_2rps"] > 0
    sweep = doc["details"]["disagg1"]["sweep"]
    assert [r["rate"] for r in sweep] == [2.0] and not sweep[0]["errors"] and sweep[0]["ttft_ms"]["count"] == 3
    (host,) = doc["details"]["disagg1"]["decode_host_commands"]  # the decode's line at stop: on CPU no GPU wait
    assert "0 of" in host and "host-only commands (import reservations, first tokens, ends) ran while a step" in host
    assert doc["details"]["disagg1"]["up_mode_line"] == (
        "pdserve up: mode disaggregated (prefill + decode engines): --disaggregated"
    )
    data = load_measurements(mode_data)
    entry = data["cpu"]  # a CPU run decides CPU stacks only
    assert entry["disaggregated_goodput_rps"] == doc["disagg1_goodput_rps"] and "32 -> 8 tokens" in entry["workload"]
    assert data["one_gpu"] == load_measurements()["one_gpu"]  # the packaged file's entry kept
    choice = choose_mode([], data)
    assert doc["default_mode"] == choice.mode and doc["details"]["default_mode_line"] == choice.line()
    assert choice.mode == ("colocated" if doc["disagg1_goodput_rps"] < 2.0 else "disaggregated")  # TTFT 1e4 ms


@pytest.mark.timeout(240)
def test_the_grpc_part_once_per_shipper_count_side_by_side(tmp_path):
    """--kv-shippers 1,2: the grpc part on a stack per entry (~15 s each on CPU), each with a raw gRPC stream
    beside it; the keys are the last entry's, every run in details."""
    model = build_checkpoint(tmp_path / "tiny", arch="llama", seed=1, vocab_size=128256, max_position_embeddings=4096)
    out = tmp_path / "one_gpu.json"
    cmd = [sys.executable, str(ROOT / "bench" / "one_gpu.py"), "--part", "grpc", "--kv-shippers", "1,2"]
    cmd += ["--gpus", "none", "--model", str(model), "--json", str(out), "--workdir", str(tmp_path / "work")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    side = doc["details"]["grpc_shippers_side_by_side"]
    assert [r["kv_shippers"] for r in side["runs"]] == [1, 2] and set(side["median"]) == {"1", "2"}
    last = side["runs"][-1]
    assert doc["kv_gbps_grpc"] == last["kv_gbps"] > 0 and doc["raw_grpc_gbps"] == last["raw_grpc_gbps"] > 0
    assert doc["t2t_ms_2k_grpc"] == last["t2t_ms_2k"] >= last["ttft_ms_2k"] > 0
    assert last["ratio"] == pytest.approx(last["kv_gbps"] / last["raw_grpc_gbps"])
    for i, n in enumerate([1, 2]):  # each stack ran that many shipper processes on each end
        logs = tmp_path / "work" / f"served-shippers-{n}-{i}"
        assert (logs / "prefill0.log").read_text().count("kv shipper (prefill): process") == n
        assert (logs / "decode0.log").read_text().count("kv shipper (decode): process") == n
