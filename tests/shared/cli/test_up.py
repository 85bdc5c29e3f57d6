"""`pdserve up`'s parser: the engine flags are the engine services' own, handed on as given; bad ones stop it
before anything starts."""

import subprocess
import sys

from pdserve.cli.up import engine_settings, up_parser
from pdserve.config import given_flags, settings
from pdserve.decode.config import DecodeConfig


def test_pdserve_up_takes_every_engine_flag_and_hands_them_on():
    flags = {a for action in up_parser()._actions for a in action.option_strings}
    engine = [s for s in settings(DecodeConfig) if s.path[0] == "engine" and s.name != "model"]
    assert {s.flag for s in engine} <= flags and "--torch-threads" in flags
    args = up_parser().parse_args(["--kv-dtype", "fp8", "--chunk-size", "64", "--cuda-graphs", "--prefill", "2"])
    assert given_flags(args, engine_settings()) == ["--chunk-size", "64", "--kv-dtype", "fp8", "--cuda-graphs", "true"]
    assert args.prefill == 2  # the stack's own --prefill (a count), not the router's address list
    assert given_flags(up_parser().parse_args([]), engine_settings()) == []  # not given: each service's default


def test_bad_engine_flag_stops_up_before_anything_starts(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(tmp_path), "--kv-dtype", "fp4", "--gpus", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "--kv-dtype must be 'auto', 'int8' or 'fp8', got 'fp4'" in res.stderr
    assert "pdserve is up" not in res.stdout and not list(tmp_path.iterdir())


def test_banner_lists_every_metrics_address_with_the_gateway_last():
    from types import SimpleNamespace

    from pdserve.cli.up import _metrics_lines

    def addr(port: int, metrics: str) -> SimpleNamespace:
        return SimpleNamespace(port=port, metrics=metrics)

    stack = SimpleNamespace(
        router=addr(1, "h:9000"),
        prefill=[addr(2, "h:9001")],
        decode=[addr(3, "h:9002")],
        colocated=[],
        gateway="h:8000",
    )
    assert _metrics_lines(stack) == [
        "router http://h:9000/metrics",
        "prefill0 http://h:9001/metrics",
        "decode0 http://h:9002/metrics",
        "gateway http://h:8000/metrics",
    ]
    assert _metrics_lines(SimpleNamespace(**{**vars(stack), "gateway": ""}))[-1] == "decode0 http://h:9002/metrics"
