import argparse

import pytest

from pdserve.config import add_dataclass_args, config_from
from pdserve.decode.config import DecodeConfig
from pdserve.router.config import RouterConfig


def parse(cls, argv, env):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls)
    return config_from(cls, p.parse_args(argv), "PDSERVE_X_", environ=env)


def test_cli_overrides_env_overrides_default():
    cfg = parse(
        DecodeConfig, ["--model", "m", "--page-size", "8"], {"PDSERVE_X_PAGE_SIZE": "4", "PDSERVE_X_KV_DTYPE": "auto"}
    )
    assert (cfg.page_size, cfg.kv_dtype, cfg.chunk_size) == (8, "auto", 2048)


def test_lists_and_bools():
    cfg = parse(RouterConfig, ["--model", "m", "--prefill", "a:1", "--prefill", "b:2"], {"PDSERVE_X_DECODE": "c:3,d:4"})
    assert cfg.prefill == ["a:1", "b:2"] and cfg.decode == ["c:3", "d:4"]
    cfg = parse(DecodeConfig, ["--model", "m"], {"PDSERVE_X_KV_ASYMMETRIC": "true"})
    assert cfg.kv_asymmetric is True


def test_invalid_values_exit_with_reason():
    with pytest.raises(SystemExit, match="kv-dtype"):
        parse(DecodeConfig, ["--model", "m", "--kv-dtype", "fp4"], {})
    with pytest.raises(SystemExit, match="page_size"):
        parse(DecodeConfig, ["--model", "m", "--page-size", "x"], {})
    with pytest.raises(SystemExit, match="--model"):
        parse(DecodeConfig, [], {})
