"""CLI conventions: `--version`, unknown commands named, yes/no flags as `--x/--no-x` switches (older `--x true`
still works), help texts with defaults and environment variables."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.cli.main import main
from pdserve.cli.up import up_parser
from pdserve.config import add_dataclass_args, config_from
from pdserve.decode.config import ENV_PREFIX, DecodeConfig


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pdserve {version('pdserve')}"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["serve", "frob"], "unknown service 'frob'"),
        (["serve"], "no service given"),
    ],
)
def test_unknown_commands_fail_with_a_message(capsys, argv, said):
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def _decode(argv: list[str], environ: dict[str, str] | None = None) -> DecodeConfig:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, DecodeConfig, env_prefix=ENV_PREFIX)
    return config_from(DecodeConfig, p.parse_args(["--model", "m", *argv]), ENV_PREFIX, environ or {})


def test_boolean_settings_are_switches_and_take_old_values():
    assert _decode([]).warmup is True
    assert _decode(["--no-warmup"]).warmup is False
    assert _decode(["--warmup"], {f"{ENV_PREFIX}WARMUP": "false"}).warmup is True  # flag over environment
    assert _decode(["--warmup", "false"]).warmup is False  # command lines from before the switches
    assert _decode(["--no-insecure"]).insecure is False and _decode(["--insecure"]).insecure is True
    assert _decode(["--cuda-graphs", "off"]).engine.cuda_graphs is False
    with pytest.raises(SystemExit):
        _decode(["--warmup", "maybe"])


def test_help_shows_defaults_and_environment_variables():
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "decode", "--help"], capture_output=True, text=True, timeout=60
    )
    out = " ".join(res.stdout.split())  # argparse wraps lines
    assert res.returncode == 0
    assert "--kv-cache-memory" in out and "(default: auto; $PDSERVE_DECODE_KV_CACHE_MEMORY)" in out
    assert "--no-warmup" in out and "(default: on; $PDSERVE_DECODE_WARMUP)" in out
    up_help = " ".join(up_parser().format_help().split())
    for text in ("--metrics-port", "$PDSERVE_METRICS_PORT", "(default: 50051; $PDSERVE_PORT)", "--kv-cache-memory"):
        assert text in up_help


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_client_commands_document_target_alike(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--target TARGET router HOST:PORT (default: $PDSERVE_TARGET, else localhost:50051)" in text
