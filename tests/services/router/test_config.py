"""Router config: TOML file < environment < flags; tables group settings; bad files and values fail clearly."""

import argparse

import pytest

from pdserve.config import add_dataclass_args, config_from
from pdserve.router.config import ENV_PREFIX, RouterConfig

TOML = """
model = "/models/m"
prefill = ["10.0.0.1:6000", "10.0.0.2:6000"]
decode = ["10.0.0.3:7000"]
policy = "pcs"

[pcs]
w_in = 0.25
fallback_mode = "max_tokens"

[estimator]
store = "redis://127.0.0.1:6379/0"

[admission]
batch_utilization_threshold = 0.7
prefill_capacity_pcs = 4000

[priority]
high = 2.0
"""


def load(argv, env, tmp_path=None, text=TOML):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, RouterConfig)
    if tmp_path is not None:
        (tmp_path / "router.toml").write_text(text)
        argv = ["--config", str(tmp_path / "router.toml"), *argv]
    return config_from(RouterConfig, p.parse_args(argv), ENV_PREFIX, environ=env)


def test_file_values_and_tables(tmp_path):
    cfg = load([], {}, tmp_path)
    assert cfg.model == "/models/m" and cfg.prefill == ["10.0.0.1:6000", "10.0.0.2:6000"]
    assert cfg.decode == ["10.0.0.3:7000"]
    assert (cfg.pcs_w_in, cfg.pcs_w_out, cfg.pcs_fallback_mode) == (0.25, 0.5, "max_tokens")
    assert cfg.estimator_store == "redis://127.0.0.1:6379/0"
    assert (cfg.batch_utilization_threshold, cfg.prefill_capacity_pcs, cfg.priority_high) == (0.7, 4000.0, 2.0)


def test_env_overrides_file_and_flags_override_env(tmp_path):
    env = {
        "PDSERVE_ROUTER_PCS_W_IN": "0.4",
        "PDSERVE_ROUTER_BATCH_UTILIZATION_THRESHOLD": "0.9",
        "PDSERVE_ROUTER_DECODE": "a:1,b:2",
    }
    cfg = load(["--batch-utilization-threshold", "0.6"], env, tmp_path)
    assert (cfg.pcs_w_in, cfg.batch_utilization_threshold, cfg.decode) == (0.4, 0.6, ["a:1", "b:2"])
    # the file named by the environment alone
    (tmp_path / "other.toml").write_text('model = "x"\n[assignment]\naffinity = false\n')
    cfg = load([], {"PDSERVE_ROUTER_CONFIG": str(tmp_path / "other.toml")})
    assert cfg.model == "x" and cfg.affinity is False


@pytest.mark.parametrize(
    "text, reason",
    [
        ('model = "m"\nbogus = 1\n', "unknown setting 'bogus'"),
        ('model = "m"\n[pcs]\nw_typo = 1\n', "unknown setting '[pcs] w_typo'"),
        ('model = "m"\nmax_queue = "lots"\n', "invalid value for max_queue"),
        ('model = "m"\npolicy = "random"\n', "policy must be one of"),
        ('model = "m"\nbatch_utilization_threshold = 1.5\n', "batch_utilization_threshold must be in (0, 1]"),
        ("model = [1\n", "cannot read config file"),
    ],
)
def test_bad_files_fail_with_reason(tmp_path, text, reason):
    with pytest.raises(SystemExit) as e:
        load([], {}, tmp_path, text=text)
    assert reason in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(SystemExit, match="cannot read config file"):
        load(["--config", str(tmp_path / "nope.toml")], {})
