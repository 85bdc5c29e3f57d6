"""`pdserve up`'s serving mode: forced by --colocated / --disaggregated / --prefill / --decode (conflicts refused),
else on one GPU the mode of the higher measured goodput in the data file, with the figures as its reason; the
default (prefill + decode) without a measurement, on CPU without a `cpu` entry, and on two GPUs or more."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.cli import mode_choice
from pdserve.cli.mode_choice import SCHEMA, choose_mode, load_measurements
from pdserve.cli.up import _choose_mode, up_parser


def measured(coloc: float, disagg: float, t_coloc: float | None = 60.0, t_disagg: float | None = 70.0) -> dict:
    return dict(
        measured=True, colocated_goodput_rps=coloc, disaggregated_goodput_rps=disagg,
        colocated_ttft_ms_p50_2rps=t_coloc, disaggregated_ttft_ms_p50_2rps=t_disagg,
        device="1x NVIDIA H200", workload="2048 -> 128 tokens", commit="abc1234", date="2026-12-02",
    )  # fmt: skip


def data(**entries) -> dict:
    return {"schema": SCHEMA, **entries}


def test_one_gpu_takes_the_mode_of_the_higher_goodput_and_says_why():
    c = choose_mode([0], data(one_gpu=measured(10, 8)))
    assert c.mode == "colocated" and c.colocated
    assert "goodput 10 req/s colocated vs 8 disaggregated" in c.reason and "1x NVIDIA H200" in c.reason
    assert "abc1234" in c.reason and "cuda:0" in c.reason
    d = choose_mode([3], data(one_gpu=measured(6, 8.5)))
    assert d.mode == "disaggregated" and not d.colocated and "6 req/s colocated vs 8.5 disaggregated" in d.reason


def test_a_goodput_tie_goes_to_the_lower_ttft_else_to_the_default():
    c = choose_mode([0], data(one_gpu=measured(8, 8, t_coloc=50, t_disagg=75)))
    assert c.mode == "colocated" and "a tie" in c.reason and "50 ms colocated vs 75 ms" in c.reason
    assert choose_mode([0], data(one_gpu=measured(8, 8, t_coloc=90, t_disagg=75))).mode == "disaggregated"
    tie = choose_mode([0], data(one_gpu=measured(8, 8, t_coloc=None)))
    assert tie.mode == "disaggregated" and "a tie; the default" in tie.reason


def test_without_a_measurement_the_default_says_so():
    unmeasured = choose_mode([0], data(one_gpu={"measured": False, "reason": "not run on a GPU yet"}))
    assert unmeasured.mode == "disaggregated"
    assert "no measurement (not run on a GPU yet); the default" in unmeasured.reason
    assert "no measurement (no entry)" in choose_mode([0], {}).reason
    half = choose_mode([0], data(one_gpu={"measured": True, "colocated_goodput_rps": 9.0}))
    assert half.mode == "disaggregated" and "lacks a goodput" in half.reason
    nan = choose_mode([0], data(one_gpu=measured(float("nan"), 8)))
    assert nan.mode == "disaggregated" and "lacks a goodput" in nan.reason


def test_two_gpus_split_the_roles_and_cpu_follows_only_a_cpu_entry():
    many = choose_mode([0, 1], data(one_gpu=measured(12, 8)))
    assert many.mode == "disaggregated" and "2 GPUs" in many.reason
    assert choose_mode([], data(one_gpu=measured(12, 8))).mode == "disaggregated"  # a GPU figure: not for CPU
    cpu = choose_mode([], data(cpu=measured(3, 2)))
    assert cpu.mode == "colocated" and cpu.reason.startswith("no GPU placement: measured")


def test_the_data_file_is_read_only_when_it_is_ours(tmp_path):
    path = tmp_path / "mode_choice.json"
    assert load_measurements(path) == {}  # missing
    path.write_text("{not json")
    assert load_measurements(path) == {}
    path.write_text(json.dumps({"schema": "other/1", "one_gpu": measured(10, 8)}))
    assert load_measurements(path) == {}
    path.write_text(json.dumps(data(one_gpu=measured(10, 8), pad="x" * mode_choice.MAX_DATA_BYTES)))
    assert load_measurements(path) == {}  # too large
    path.write_text(json.dumps(data(one_gpu=measured(10, 8))))
    assert choose_mode([0], load_measurements(path)).mode == "colocated"


def test_the_packaged_data_file_is_valid_and_its_one_gpu_entry_complete():
    doc = load_measurements()
    assert doc["schema"] == SCHEMA, "pdserve/data/mode_choice.json is missing or not ours"
    entry = doc["one_gpu"]
    if entry["measured"]:  # written by bench/one_gpu.py from a run: both goodputs and where they come from
        assert {"colocated_goodput_rps", "disaggregated_goodput_rps", "device", "commit", "date"} <= set(entry)
    else:
        assert entry["reason"] and "no measurement" in choose_mode([0], doc).reason


def up_args(*argv: str):
    p = up_parser()
    return p, p.parse_args(["--model", "m", *argv])


@pytest.mark.parametrize(
    "argv",
    [("--colocated", "--disaggregated"), ("--colocated", "2", "--prefill", "2"), ("--colocated", "--decode", "1")],
)
def test_conflicting_mode_flags_stop_up(argv, capsys):
    p, args = up_args("--gpus", "0", *argv)
    with pytest.raises(SystemExit):
        _choose_mode(p, args)
    assert "--colocated runs colocated engines: it excludes --disaggregated, --prefill and --decode" in (
        capsys.readouterr().err
    )


def test_flags_force_the_mode_and_one_gpu_follows_the_data(monkeypatch, tmp_path):
    path = tmp_path / "mode_choice.json"
    path.write_text(json.dumps(data(one_gpu=measured(10, 8))))
    monkeypatch.setattr(mode_choice, "DATA_FILE", path)
    p, args = up_args("--gpus", "0")
    gpus, mode = _choose_mode(p, args)
    assert (
        gpus == [0]
        and mode.colocated
        and args.colocated == 1
        and mode.line().startswith(
            "pdserve up: mode colocated (engines that prefill and decode): one GPU (cuda:0): measured goodput 10"
        )
    )
    p, args = up_args("--gpus", "0", "--disaggregated")
    gpus, mode = _choose_mode(p, args)
    assert not mode.colocated and args.colocated == 0 and (args.prefill, args.decode) == (1, 1)
    assert mode.reason == "--disaggregated"
    p, args = up_args("--gpus", "0", "--prefill", "2")
    assert _choose_mode(p, args)[1].reason == "--prefill / --decode given" and (args.prefill, args.decode) == (2, 1)
    p, args = up_args("--gpus", "0,1")
    assert _choose_mode(p, args)[1].mode == "disaggregated" and args.colocated == 0
    p, args = up_args("--gpus", "0", "--colocated", "2")
    assert _choose_mode(p, args)[1].reason == "--colocated 2" and args.colocated == 2


def test_up_prints_the_mode_and_its_reason(tmp_path):
    """The real command: the mode line comes first; a bad engine flag then stops it before anything starts."""
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(tmp_path), "--kv-dtype", "fp4", "--gpus", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "--kv-dtype must be" in res.stderr
    assert res.stdout.splitlines()[0] == choose_mode([], load_measurements()).line(), res.stdout
